"""MegatronEngine on 2 ranks (TP=1 x DP=2, TP=2, PP=2, CP=2) and `aligner generate` (TP=2), against
recomputation without a KV cache and trainer-side log-probs. One launch runs every engine check
(tests/generation_workers.py); the tests below read its results.

Tolerances: log-probs 1e-5 (fp32, CPU); tokens exactly equal.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.launch.local import launch
from tests.conftest import REPO, cli_env

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("generation")
    launch("tests.generation_workers:main", [str(workdir)], 2, log_dir=workdir / "logs")
    out = json.loads((workdir / "results.json").read_text())
    out["_workdir"] = str(workdir)
    return out


def _true(results, *keys):
    failed = [k for k in keys if results.get(k) is not True]
    assert not failed, {k: results.get(k) for k in failed}


def _small(results, *keys):
    large = {k: results[k] for k in keys if not results[k] <= TOL}
    assert not large, large


MODES = {"tp1": ("lean", "compiled", "megatron"), "tp2": ("lean", "megatron"), "pp2": ("lean", "compiled", "megatron"),
         "tp2_sp": ("lean", "megatron")}  # decode paths per layout (compiled: TP=1 only)


@pytest.mark.dist
def test_greedy_matches_recompute_without_cache(results):
    _true(results, *(f"{tag}_{mode}_greedy_equal" for tag, modes in MODES.items() for mode in modes),
          "tp2_sp_restored", "tp2_compiled_refused")
    _small(results, *(f"tp1_{mode}_greedy_vs_recompute_logprobs" for mode in MODES["tp1"]),
           *(f"{tag}_{mode}_greedy_logprob_diff" for tag in ("tp2", "pp2") for mode in MODES[tag]))
    assert results["tp1_decode_auto"] == "lean"
    _true(results, "tp1_protocol_sleep_wake", "ranks_agree")


@pytest.mark.dist
def test_engine_logprobs_equal_trainer_logprobs(results):
    _small(results, *(f"tp1_{mode}_greedy_vs_trainer_logprobs" for mode in MODES["tp1"]),
           "tp1_sampled_vs_trainer_logprobs", "tp1_hot_vs_trainer_logprobs",
           "tp2_lean_sampled_vs_trainer_logprobs", "tp2_megatron_sampled_vs_trainer_logprobs")


@pytest.mark.dist
def test_sampling_same_across_decode_paths_and_layouts(results):
    _true(results, "tp1_sampled_paths_equal", "tp1_hot_paths_equal", "tp1_sampled_differs_from_greedy",
          *(f"{tag}_{mode}_sampled_equal" for tag in ("tp2", "pp2") for mode in MODES[tag]))
    _small(results, "tp1_sampled_paths_logprob_diff", "tp1_hot_paths_logprob_diff",
           *(f"{tag}_{mode}_sampled_logprob_diff" for tag in ("tp2", "pp2") for mode in MODES[tag]))


@pytest.mark.dist
def test_context_parallel_ranks_generate_whole_sequences_as_one_process(results):
    """Under CP=2 every CP rank is a replica of its own: the lean decoder's tokens equal one process's and
    megatron's decode path, which would split the sequence over the CP ranks, is refused."""
    assert results["cp2_decode_auto"] == "lean"
    _true(results, "cp2_lean_greedy_equal", "cp2_lean_sampled_equal", "cp2_megatron_refused")
    _small(results, "cp2_lean_greedy_logprob_diff", "cp2_lean_sampled_logprob_diff")


@pytest.mark.dist
def test_seeds_reproducible_and_batch_independent(results):
    _true(results, "tp1_seed_reproducible", "tp1_seed_independent_of_batch", "tp1_other_seed_differs")


@pytest.mark.dist
def test_stop_rules(results):
    _true(results, "tp1_eos_lengths_ok", "tp1_eos_prefix_ok", "tp1_eos_reasons_ok", "tp1_eos_is_end_ok",
          "tp1_eos_padding_ok", "tp1_stop_token_ok", "tp1_min_new_tokens_ok", "tp1_stop_string_ok",
          "tp2_eos_ok", "pp2_eos_ok")


@pytest.mark.dist
def test_optimizer_step_on_shared_model(results):
    _true(results, "train_mode_restored", "train_generations_changed", "train_generations_follow_weights",
          "train_refit_check_shared", "train_after_generate_ok")


@pytest.mark.dist
def test_refit_from_weight_stream(results):
    _true(results, "tp1_refit_local_names", "tp2_refit_local_names", "pp2_refit_local_names")
    hf = [k for k in results if k.endswith("_refit_hf_names")]
    _true(results, *hf)


@pytest.mark.dist
@pytest.mark.parametrize("layout", [["launcher.nproc_per_node=2", "model.tensor_model_parallel_size=2"],
                                    ["decode=compiled"]], ids=["tp2", "compiled"])
def test_cli_generate_matches_engine(results, layout):
    workdir = Path(results["_workdir"])
    out = workdir / "cli_out.jsonl"
    code = ("import sys; from aligner.generation.cli import generate_main; sys.exit(generate_main(sys.argv[1:]))")
    proc = subprocess.run(
        [sys.executable, "-c", code, "--model", str(workdir / "ckpt"), "--prompts", str(workdir / "cli_prompts.jsonl"),
         "--out", str(out), "sampling.temperature=0.9", "sampling.top_p=0.95", "sampling.max_new_tokens=8",
         "sampling.seed=3", "batch_size=3", *layout],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    expected = json.loads((workdir / "cli_expected.json").read_text())
    assert [r["response_ids"] for r in lines] == expected["response_ids"]
    assert max(abs(a - b) for r, e in zip(lines, expected["logprobs"]) for a, b in zip(r["logprobs"], e)) <= TOL
    assert all(isinstance(r["response"], str) and r["stop_reason"] in ("eos", "length") for r in lines)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lean_decoder_prefill_and_steps_equal_the_model_forward(compiled):
    """LeanDecoder (one process, GQA with 2 query heads per group), eager and with its decode steps compiled:
    its prefill and each one-token step give the logits of GPTModel.forward over the whole sequence without a
    cache, also after its KV cache has grown past its first capacity (64 slots); an engine call leaves the CPU
    shims' TorchFunctionMode in place (megatron code run afterwards still has its "cuda" literals mapped)."""
    import torch

    from aligner.generation.lean_decode import LeanDecoder
    from aligner.generation.megatron_engine import MegatronEngine
    from aligner.generation.parallel import StageLayout
    from aligner.generation.types import SamplingParams
    from aligner.runtime import distributed
    from tests.generation_workers import VOCAB, setup

    distributed.init_process_group()
    model, m = setup(1, 1)
    model.eval()
    batch, prefix, steps = 3, 5, 70
    seq = torch.randint(0, VOCAB, (batch, prefix + steps), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(seq, torch.arange(seq.shape[1]).expand(batch, -1), None)[..., :VOCAB]
        decoder = LeanDecoder(model, StageLayout.current(), batch, prefix + steps, compiled=compiled)
        lean = [decoder.forward(decoder.embed(seq[:, :prefix]), 0)]
        lean += [decoder.forward(decoder.embed(seq[:, t:t + 1]), t) for t in range(prefix, prefix + steps)]
        with pytest.raises(ValueError, match="only supported at slot 0"):
            decoder.forward(decoder.embed(seq[:, :2]), 3)
    lean = torch.stack(lean, 1)[..., :VOCAB]
    assert (lean - full[:, prefix - 1:]).abs().max().item() <= TOL
    grown = 80 if compiled else prefix + steps  # from 64 to max_seq (compiled: rounded up to a multiple of 16)
    assert [k.shape[2] for k, _ in decoder.cache] == [grown] * len(decoder.cache)

    MegatronEngine(model, m, VOCAB, eos_id=None).generate([[1, 2, 3]], SamplingParams(greedy=True, max_new_tokens=2))
    if not torch.cuda.is_available():
        assert torch.zeros(1, device="cuda").device.type == "cpu"
