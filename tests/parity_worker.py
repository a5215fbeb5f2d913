"""Rank entry points for the parallelism parity tests (launched by tests/integration/test_parallel_parity.py), and
the helpers that compare a parallel layout's tensors with a TP=1 run's (also used by the preference and
generation rank entry points).

`reference`: one process, TP=PP=CP=DP=1. Saves initial weights as a checkpoint, then the logits,
per-token loss and every gradient of one forward/backward on a fixed batch, and the parameters
after two Adam steps. `parallel`: loads those weights under a parallel layout (dist_checkpointing
reshards them), repeats the same computation and writes the largest differences per quantity.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

VOCAB, BATCH, LENGTH, STEPS = 500, 8, 32, 2


def fixed_batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
    mask = (torch.rand(BATCH, LENGTH, generator=g) > 0.3).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask}


def make_config(layout: dict):
    from aligner.config.schema import SFTRunConfig

    cfg = OmegaConf.structured(SFTRunConfig)
    cfg.model.num_query_groups = 2  # exercise GQA
    cfg.model.seq_length = LENGTH
    cfg.optim.warmup_steps, cfg.optim.scheduler, cfg.optim.lr = 0, "constant", 1e-3
    return with_layout(cfg, layout)


def with_layout(cfg, layout: dict):
    """A resolved copy of run config `cfg` with `layout`'s dotted keys set (e.g. model.tensor_model_parallel_size)."""
    for key, value in layout.items():
        OmegaConf.update(cfg, key, value)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def my_shard_of(name: str, full: torch.Tensor, param) -> torch.Tensor:
    """The slice of a TP=1 tensor that this TP rank holds (SwiGLU fc1 holds [gate_r; up_r])."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0)
    return full.chunk(tp, dim=param.partition_dim)[r]


def global_name(name: str, model_cfg) -> str:
    """A parameter's name in the whole model: this pipeline stage's layer numbers offset to the global ones."""
    from aligner.models.gpt import layer_offset

    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset(model_cfg))
    return ".".join(parts)


def logits_forward_step(data_iterator, model):
    """Forward-only step whose 'loss' hands back the full-vocabulary logits in global order."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from aligner.models.forward_step import run_model

    output, batch = run_model(next(data_iterator), model, None)

    def collect(logits):
        full = gather_from_tensor_model_parallel_region(logits)
        cp = ps.get_context_parallel_world_size()
        if cp > 1:  # put the CP ranks' chunks back in sequence order
            parts = [torch.empty_like(full) for _ in range(cp)]
            dist.all_gather(parts, full.contiguous(), group=ps.get_context_parallel_group())
            order = torch.cat([batch_positions(cp, r, LENGTH) for r in range(cp)])
            full = torch.cat(parts, 1)[:, torch.argsort(order)]
        return torch.zeros((), requires_grad=True), torch.tensor(1), {"logits": full.detach()}

    return output, collect


def batch_positions(cp, rank, length):
    from aligner.models.cp_attention import positions_on_rank

    return positions_on_rank(length, cp, rank)


def run(mode: str, workdir: Path, layout: dict) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from aligner.algorithms.shared.sft import sft_forward_step
    from aligner.algorithms.shared.training_step import forward_backward
    from aligner.models import checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.training import wrap_for_training
    from aligner.runtime import distributed
    from aligner.runtime.seeding import seed_everything

    cfg = make_config(layout)
    m = cfg.model
    distributed.init_process_group()
    torch.set_num_threads(1)
    distributed.init_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                                    m.context_parallel_size)
    seed_everything(1)
    gpt = build_gpt(m, VOCAB)
    if mode == "reference":
        checkpoint.save_checkpoint(workdir / "init", gpt, m, VOCAB)
    else:
        checkpoint.load_weights(workdir / "init", gpt)
    model, optimizer, _ = wrap_for_training(gpt, m, cfg.optim)
    assert gpt.config.sequence_parallel == m.sequence_parallel
    batch = fixed_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = cfg.trainer.micro_batch_size
    mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
    micro = [{k: v[i:i + mbs] for k, v in mine.items()} for i in range(0, BATCH // dp, mbs)]

    # logits (forward only, through the same schedule)
    outputs = get_forward_backward_func()(
        forward_step_func=logits_forward_step, data_iterator=iter(micro), model=[model],
        num_microbatches=len(micro), seq_length=LENGTH, micro_batch_size=mbs, forward_only=True)
    result = {}
    if ps.is_pipeline_last_stage():
        logits = torch.cat([o["logits"] for o in outputs])[..., :VOCAB]
        result["logits"] = logits
    # loss and gradients of one step
    forward_step = sft_forward_step(VOCAB)
    sums = forward_backward(model, optimizer, forward_step, micro, LENGTH)
    result["loss"] = sums["loss"] / sums["count"]
    result["grads"] = {global_name(n, m): p.main_grad.detach().clone() for n, p in gpt.named_parameters()}
    # two optimizer steps
    for step in range(STEPS):
        if step:  # same order as Trainer.train_step
            forward_backward(model, optimizer, forward_step, micro, LENGTH)
        optimizer.step()
    result["params"] = {global_name(n, m): p.detach().clone() for n, p in gpt.named_parameters()}

    if mode == "reference":
        torch.save(result, workdir / "reference.pt")
    else:
        ref = torch.load(workdir / "reference.pt")
        diffs = {"loss": abs(result["loss"] - ref["loss"])}
        if "logits" in result:
            diffs["logits"] = (result["logits"].reshape(ref["logits"].shape) - ref["logits"]).abs().max().item() \
                if dp == 1 else (result["logits"] - ref["logits"].chunk(dp)[dp_rank]).abs().max().item()
        params = dict(gpt.named_parameters())
        # Under the distributed optimizer main_grad holds only this rank's reduce-scattered shard.
        for key in ("params",) if cfg.optim.distributed_optimizer else ("grads", "params"):
            diffs[key] = max((value - my_shard_of(name, ref[key][name], params[local])).abs().max().item()
                             for local, (name, value) in zip(params, result[key].items()))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, diffs)
        if dist.get_rank() == 0:
            worst = {k: max(d[k] for d in gathered if k in d) for k in ("loss", "logits", "grads", "params")
                     if any(k in d for d in gathered)}
            (workdir / f"diff_{layout_name(layout)}.json").write_text(json.dumps(worst))
    distributed.shutdown()


def layout_name(layout: dict) -> str:
    return "_".join(f"{k.split('.')[-1]}={v}" for k, v in sorted(layout.items())) or "reference"


def main(argv: list[str]) -> None:
    mode, workdir = argv[0], Path(argv[1])
    layout = json.loads(argv[2]) if len(argv) > 2 else {}
    run(mode, workdir, layout)


if __name__ == "__main__":
    main(sys.argv[1:])
