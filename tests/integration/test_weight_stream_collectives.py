"""The weight stream (`iter_hf_weights`) and the TensorRT-LLM refit protocol (`send_weight_stream`) make the
same collective calls on every rank, whatever each rank holds (a rank that skips a call its peers make hangs
the job), at world size 2 (TP2, PP2) and 4 (TP2 x PP2, and PP2 with two data-parallel replicas), on gloo.
The streamed tensors equal the Hugging Face model's bit for bit. One launch per world size
(tests/weight_stream_workers.py); TensorRT-LLM itself is never faked, only the IPC handle is a stand-in."""
from __future__ import annotations

import json

import pytest
import torch

from aligner.models import hf_weights as hw
from tests import hf_workers as hfw

pytestmark = pytest.mark.dist
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (1, 2)]}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny Llama (GQA, untied head, 2 layers) as {"config", "state"}."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hfw.hf_config("llama"), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    config = {**model.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    return {"config": config, "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def world(request, hf_model, tmp_path_factory):
    """{(tp, pp): [each rank's results]} of one launch at the world size."""
    from aligner.launch.local import launch

    size = request.param
    workdir = tmp_path_factory.mktemp(f"world{size}")
    torch.save(hf_model, workdir / "hf.pt")
    launch("tests.weight_stream_workers:main", [str(workdir), json.dumps(LAYOUTS[size])], size, log_dir=workdir / "logs")
    return {layout: [json.loads((workdir / f"tp{layout[0]}pp{layout[1]}.rank{r}.json").read_text())
                     for r in range(size)] for layout in LAYOUTS[size]}


def _sequence(calls) -> list:
    """(op, shape, dtype) per call: what must match across ranks (the groups differ by rank)."""
    return [(op, shape, dtype) for op, _, shape, dtype in calls]


@pytest.mark.parametrize("all_ranks", [False, True])
def test_every_rank_makes_the_same_calls_and_receives_the_model(world, hf_model, all_ranks):
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig

    fields = hw.model_fields_from_hf(hf_model["config"])
    g = hw.Geometry.of(OmegaConf.merge(OmegaConf.structured(ModelConfig), fields), fields["vocab_size"], tp=1)
    split = [n for n in hw.mcore_names(g) if hw.split_rule(n) is not None]
    for (tp, pp), ranks in world.items():
        runs = [r[f"all_ranks={all_ranks}"] for r in ranks]
        first = _sequence(runs[0]["stream_calls"])
        ops = [op for op, _, _ in first]
        # the protocol: a pipeline broadcast of every parameter, a TP gather of every split one
        assert ops.count("broadcast") == (len(hw.mcore_names(g)) if pp > 1 else 0), (tp, pp)
        assert ops.count("all_gather") == (len(split) if tp > 1 else 0) and len(ops) == len(first), (tp, pp)
        for rank, run in enumerate(runs):
            assert _sequence(run["stream_calls"]) == first, (tp, pp, rank)
            assert run["buckets"] == runs[0]["buckets"] > 3, (tp, pp, rank)  # 16 KiB buckets: really chunked
            receiver = all_ranks or rank == 0
            assert run["received"] == receiver and run["equal"] in ((True,) if receiver else (None,)), (tp, pp, rank)


@pytest.mark.parametrize("all_ranks", [False, True])
def test_refit_gathers_once_per_bucket_on_every_rank_and_keeps_the_tensors(world, hf_model, all_ranks):
    sums = {k: float(t.double().sum()) for k, t in hf_model["state"].items()}
    for (tp, pp), ranks in world.items():
        runs = [r[f"all_ranks={all_ranks}"] for r in ranks]
        first = _sequence(runs[0]["refit_calls"])
        for rank, run in enumerate(runs):
            assert _sequence(run["refit_calls"]) == first, (tp, pp, rank)  # ranks holding nothing included
            gathers = [c for c in run["refit_calls"] if c[0] == "all_gather_object"]
            assert len(gathers) == run["refit_buckets"] == run["buckets"], (tp, pp, rank)
            assert run["refit_calls"][-1][0] == "barrier"
            assert run["dead_at_next_bucket"] == 0 and run["dead_after"] == run["handed"], (tp, pp, rank)
        updates = runs[0]["updates"]
        assert updates[-1] is None and runs[0]["dead_at_update"] == 0 and not any(r["updates"] for r in runs[1:])
        holders = [f"rank{r}" for r in (range(len(runs)) if all_ranks else [0])]
        for holder in holders:
            handed = [(name, rank, total) for payload in updates[:-1] for name, rank, total in payload.get(holder, [])]
            assert sorted(name for name, _, _ in handed) == sorted(sums), (tp, pp, holder)
            assert all(f"rank{rank}" == holder and total == pytest.approx(sums[name], rel=1e-12, abs=1e-12)
                       for name, rank, total in handed), (tp, pp, holder)
        assert all(set(payload) == set(holders) for payload in updates[:-1]), (tp, pp)
