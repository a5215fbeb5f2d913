"""Rank entry points of the LoRA parity test (tests/integration/test_lora.py).

`reference`: one process. Saves the seeded model as the base checkpoint, adds rank-4 adapters on the
four linears, checks that fresh adapters give the base's logits bit for bit, counts what has gradients
and optimizer state, then takes three Adam steps on a fixed batch, recording each step's loss and grad
norm, saving a LoRA checkpoint after step 2, and keeping the adapters after steps 2 and 3.
`parallel`: the same at a parallel layout (the base loaded and resharded by dist_checkpointing): steps
1-3 from the base; then the reference's step-2 LoRA checkpoint (adapters and Adam state, saved at TP=1)
resumed at this layout and step 3 taken again. Writes the largest differences.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.parity_worker import BATCH, LENGTH, VOCAB, fixed_batch, global_name, make_config

RANK, STEPS = 4, 3


def _shard(name: str, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of a TP=1 adapter tensor: column-parallel B by rows as the base weight (the
    gated fc1's [gate; up] halves each split), row-parallel A by columns, the rest whole."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    column = ".linear_qkv." in name or ".linear_fc1." in name
    if tp == 1 or (column and name.endswith(".a")) or (not column and name.endswith(".b")):
        return full
    if not column:
        return full.chunk(tp, dim=1)[r]
    if ".linear_fc1." in name:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0)
    return full.chunk(tp, dim=0)[r]


def _adapters(gpt, m) -> dict:
    return {global_name(n, m): p.detach().clone() for n, p in gpt.named_parameters() if ".lora." in n}


def _build(cfg, workdir: Path, mode: str):
    from aligner.models import checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.runtime.seeding import seed_everything

    m = cfg.model
    seed_everything(1)
    gpt = build_gpt(m, VOCAB)
    if mode == "reference" and not (workdir / "base").exists():
        checkpoint.save_checkpoint(workdir / "base", gpt, m, VOCAB)
    else:
        checkpoint.load_weights(workdir / "base", gpt)
    return gpt


def run(mode: str, workdir: Path, layout: dict) -> None:
    from megatron.core import parallel_state as ps

    from aligner.algorithms.shared.sft import sft_forward_step
    from aligner.algorithms.shared.training_step import forward_backward, forward_only, optimizer_step
    from aligner.models import checkpoint
    from aligner.models.training import wrap_for_training
    from aligner.runtime import distributed

    cfg = make_config({**layout, "model.lora.rank": RANK, "model.lora.alpha": 8.0,
                       "model.pretrained": str(workdir / "base")})
    m = cfg.model
    distributed.init_process_group()
    torch.set_num_threads(1)
    distributed.init_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                    m.context_parallel_size)
    gpt = _build(cfg, workdir, mode)
    batch = fixed_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = cfg.trainer.micro_batch_size
    mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    micro = [{k: v[i:i + mbs] for k, v in mine.items()} for i in range(0, BATCH // dp, mbs)]
    forward_step = sft_forward_step(VOCAB)
    result = {}
    if mode == "reference":  # the base's loss, before any adapter exists
        result["base_loss"] = forward_only(gpt, forward_step, micro, LENGTH)["loss"]
    model, optimizer, scheduler = wrap_for_training(gpt, m, cfg.optim)
    if mode == "reference":
        fresh = forward_only(model, forward_step, micro, LENGTH)["loss"]
        result["fresh_equals_base"] = fresh == result["base_loss"]
        result["trainable"] = sorted(n for n, p in gpt.named_parameters() if p.requires_grad)
        result["with_grad_buffer"] = sorted(n for n, p in gpt.named_parameters() if hasattr(p, "main_grad"))
        state = optimizer.optimizer.param_groups
        names = {id(p): n for n, p in gpt.named_parameters()}
        result["in_optimizer"] = sorted(names[id(p)] for g in state for p in g["params"])
    losses, norms = [], []
    for step in range(STEPS):
        sums = forward_backward(model, optimizer, forward_step, micro, LENGTH)
        norm, _ = optimizer_step(optimizer, scheduler)
        losses.append(sums["loss"] / sums["count"])
        norms.append(norm)
        if step == 1:
            result["adapters_2"] = _adapters(gpt, m)
            if mode == "reference":
                checkpoint.save_checkpoint(workdir / "lora_step2", model, m, VOCAB, optimizer=optimizer,
                                           trainer_state={"step": 2, "scheduler": scheduler.state_dict()})
    result.update(losses=losses, norms=norms, adapters_3=_adapters(gpt, m))
    # what TensorRT-LLM's refit and the HF export receive from the live model: the merged weights
    from aligner.models.weight_stream import iter_hf_weights

    streamed = {k: v.clone() for bucket in iter_hf_weights(model, m, VOCAB) for k, v in bucket.items()}
    if mode == "reference":
        result["streamed"] = streamed
        with torch.no_grad():  # by hand: W + (alpha / r) B A of the TP=1 tensors
            qkv = gpt.decoder.layers[0].self_attention.linear_qkv
            result["merged_by_hand"] = qkv.weight + 2.0 * qkv.lora.b @ qkv.lora.a
    if mode == "reference":
        torch.save(result, workdir / "reference.pt")
        distributed.shutdown()
        return

    ref = torch.load(workdir / "reference.pt")
    diffs = {"loss": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
             "grad_norm": max(abs(a - b) for a, b in zip(norms, ref["norms"])),
             "adapters": max((v - _shard(n, ref["adapters_3"][n])).abs().max().item()
                             for n, v in result["adapters_3"].items())}
    if dist.get_rank() == 0:
        diffs["streamed"] = max((v - ref["streamed"][k]).abs().max().item() for k, v in streamed.items())
        assert streamed.keys() == ref["streamed"].keys()
    else:
        diffs["streamed"] = 0.0
    # resume the reference's TP=1 checkpoint at this layout, and take step 3 again (a distributed optimizer's
    # state, sharded over DP, resumes only a checkpoint written by one: checkpoint.OPTIMIZER_METADATA)
    if not cfg.optim.distributed_optimizer:
        _resume_step_3(cfg, workdir, mode, micro, forward_step, ref, diffs)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, diffs)
    if dist.get_rank() == 0:
        worst = {k: max(d[k] for d in gathered) for k in diffs}
        name = "_".join(f"{k.split('.')[-1]}={v}" for k, v in sorted(layout.items()))
        (workdir / f"diff_{name}.json").write_text(json.dumps(worst))
    distributed.shutdown()


def _resume_step_3(cfg, workdir: Path, mode: str, micro, forward_step, ref: dict, diffs: dict) -> None:
    from aligner.algorithms.shared.training_step import forward_backward, optimizer_step
    from aligner.models import checkpoint
    from aligner.models.training import wrap_for_training

    m = cfg.model
    gpt2 = _build(cfg, workdir, mode)
    model2, optimizer2, scheduler2 = wrap_for_training(gpt2, m, cfg.optim)
    state, _ = checkpoint.load_training_state(workdir / "lora_step2", model2, optimizer2)
    scheduler2.load_state_dict(state["scheduler"])
    resumed = _adapters(gpt2, m)
    diffs["resumed_adapters"] = max((v - _shard(n, ref["adapters_2"][n])).abs().max().item()
                                    for n, v in resumed.items())
    sums = forward_backward(model2, optimizer2, forward_step, micro, LENGTH)
    norm, _ = optimizer_step(optimizer2, scheduler2)
    diffs["resumed_step3_loss"] = abs(sums["loss"] / sums["count"] - ref["losses"][2])
    diffs["resumed_step3_grad_norm"] = abs(norm - ref["norms"][2])
    diffs["resumed_step3_adapters"] = max((v - _shard(n, ref["adapters_3"][n])).abs().max().item()
                                          for n, v in _adapters(gpt2, m).items())


def main(argv: list[str]) -> None:
    run(argv[0], Path(argv[1]), json.loads(argv[2]) if len(argv) > 2 else {})


if __name__ == "__main__":
    main(sys.argv[1:])
