"""generation.backend: the engine factory, and what of the TensorRT-LLM backend runs without TensorRT-LLM
(its job-wide routing of every replica's prompts to rank 0, and the Hugging Face export it starts from), on
2 CPU ranks (tests/backend_workers.py). TensorRT-LLM itself is never faked: without it the backend refuses."""
import json

import pytest

from aligner.launch.local import launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("backends")
    launch("tests.backend_workers:main", [str(workdir)], 2, log_dir=workdir / "logs")
    return json.loads((workdir / "results.json").read_text())


def test_the_default_backend_is_the_megatron_engine(results):
    assert [r["engine"] for r in results["ranks"]] == ["MegatronEngine"] * 2


@pytest.mark.parametrize("case", ["even", "rank 1 asks nothing"])
def test_rank0_generates_for_every_replica_and_each_gets_its_own(results, case):
    for rank in results["ranks"]:
        r = rank[case]
        assert r["got"] == r["asked"] and r["same_tokens"] and r["same_stops"], r
        assert r["logprob_diff"] <= 1e-5, r


def test_the_export_loads_into_transformers_and_decodes_the_same_tokens(results):
    assert results["hf_greedy_equal"]
    assert {"config.json", "model.safetensors"} <= set(results["hf_files"])


def test_the_tensorrt_llm_backend_sleeps_once_asked_and_wakes_for_a_refit_or_a_generation(results):
    rank0, rank1 = (r["sleep_wake"] for r in results["ranks"])
    assert rank0 == ["sleep", "wake", "refit", "sleep", "wake", "generate", "generate"]
    assert rank1 == ["refit"]  # a refit is collective; the other calls are rank 0's engine's


def test_without_tensorrt_llm_the_backend_refuses_in_one_line():
    import importlib.util

    from aligner.generation.backends import build_engine
    from aligner.runtime.optional import MissingOptionalDependency

    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("TensorRT-LLM is installed here")
    with pytest.raises(MissingOptionalDependency, match="tensorrt_llm"):
        build_engine("trtllm", None, None, 1, None, batch_size=1)
