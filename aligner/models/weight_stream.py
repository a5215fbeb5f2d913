"""Stream a (TP/PP-sharded) megatron GPT as full Hugging Face tensors, a bucket at a time.

`iter_hf_weights` is collective: every rank of the model-parallel job calls it and iterates it
to the end in step. It walks the model in HF order (embedding, layer 0..L-1, final norm, head);
for each parameter the owning pipeline stage all-gathers it over tensor parallelism (data- and
context-parallel replica 0 only), converts it to HF tensors, and the stage's TP-rank-0 sends it
to global rank 0 (or, with `all_ranks=True`, broadcasts it over its pipeline group to every rank).
At most one bucket of full tensors exists at a time, so exporting or refitting a 70B model never
needs a second full copy. Every rank yields the same number of buckets; ranks that are not
receivers get empty dicts, so callers may run their own collectives per bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.models import hf_weights as hw

DEFAULT_BUCKET_BYTES = 1 << 30


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.bfloat16 from "bfloat16" (or a torch dtype as is)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def _unwrap(model):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("virtual pipeline stages (several model chunks) are not supported")
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def _stage_plan(g: hw.Geometry, pp: int) -> list[list[str]]:
    """Canonical parameter names per pipeline stage, in HF order."""
    per_stage = g.num_layers // pp
    return [hw.mcore_names(g, range(s * per_stage, (s + 1) * per_stage), embedding=s == 0, head=s == pp - 1)
            for s in range(pp)]


def _local_parameters(model, g: hw.Geometry, offset: int, expected: list[str]) -> dict[str, torch.Tensor]:
    local = {}
    for name, param in model.named_parameters():
        canonical = hw.canonical_name(name, offset)
        if canonical == "output_layer.weight" and g.tied and not g.score_outputs:
            continue  # the last stage's copy of the tied embedding
        local[canonical] = param
    if set(local) != set(expected):
        raise RuntimeError(f"model parameters do not match the expected layout: unexpected "
                           f"{sorted(set(local) - set(expected))[:5]}, missing {sorted(set(expected) - set(local))[:5]}")
    return local


@dataclass(frozen=True)
class _Layout:
    """This rank's place in the model-parallel grid."""

    tp: int
    tp_rank: int
    pp_rank: int
    replica0: bool  # data- and context-parallel rank 0
    tp_group: object
    pp_group: object
    pp_ranks: tuple  # global ranks of this rank's pipeline group, by stage

    @classmethod
    def current(cls) -> "_Layout":
        pp_group = ps.get_pipeline_model_parallel_group()
        pp_ranks = tuple(dist.get_process_group_ranks(pp_group)) if ps.get_pipeline_model_parallel_world_size() > 1 \
            else (dist.get_rank(),)
        return cls(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(),
                   replica0=ps.get_data_parallel_rank(with_context_parallel=True) == 0,
                   tp_group=ps.get_tensor_model_parallel_group(), pp_group=pp_group, pp_ranks=pp_ranks)


@torch.no_grad()
def iter_hf_weights(model, model_cfg, vocab_size: int, dtype: torch.dtype | str | None = None,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, all_ranks: bool = False,
                    score_outputs: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Yield {HF name: full tensor} buckets of at most `bucket_bytes` (a larger single tensor gets
    its own bucket) on rank 0 (or every rank with `all_ranks`). Tensors are in `dtype` (default:
    the parameters' dtype) on the parameters' device. `model_cfg` must describe the live layout.
    `score_outputs` > 0: the model carries a scalar (reward) head of that many outputs, streamed as
    HF `score.weight`."""
    dtype = as_dtype(dtype or model_cfg.params_dtype)
    layout = _Layout.current()
    pp = len(layout.pp_ranks)
    g = hw.Geometry.of(model_cfg, vocab_size, layout.tp, score_outputs=score_outputs)
    plan = _stage_plan(g, pp)
    inner = _unwrap(model)
    local = _local_parameters(inner, g, layout.pp_rank * (g.num_layers // pp), plan[layout.pp_rank])
    device = next(inner.parameters()).device
    receiver = all_ranks or dist.get_rank() == 0
    item_bytes = torch.empty((), dtype=dtype).element_size()

    bucket, bucket_size = {}, 0
    for stage, names in enumerate(plan):
        for name in names:
            size = item_bytes * torch.Size(hw.full_shape(name, g)).numel()
            if bucket_size and bucket_size + size > bucket_bytes:
                yield bucket
                bucket, bucket_size = {}, 0
            bucket_size += size
            full = _full_tensor(name, local.get(name), stage, layout, g, dtype, device, all_ranks)
            if receiver:
                bucket.update(hw.to_hf(name, full, g))
    yield bucket


def _full_tensor(name, param, stage, layout: _Layout, g, dtype, device, all_ranks):
    """The full (TP-gathered) tensor of a parameter of pipeline stage `stage`, on the receivers
    (rank 0, or every rank with `all_ranks`); None or a stale value elsewhere."""
    owner = layout.pp_rank == stage and (layout.replica0 or all_ranks)
    full = None
    if owner:
        part = param.detach().to(dtype).contiguous()
        scalar_head = g.score_outputs and name == "output_layer.weight"  # replicated over TP
        if layout.tp > 1 and hw.split_rule(name) is not None and not scalar_head:
            parts = [torch.empty_like(part) for _ in range(layout.tp)]
            dist.all_gather(parts, part, group=layout.tp_group)
            full = hw.unshard(name, parts)
        else:
            full = part
    if len(layout.pp_ranks) == 1 or (stage == 0 and not all_ranks):
        return full  # rank 0 owns stage 0
    if all_ranks:
        if full is None:
            full = torch.empty(hw.full_shape(name, g), dtype=dtype, device=device)
        dist.broadcast(full, src=layout.pp_ranks[stage], group=layout.pp_group)
        return full
    if owner and layout.tp_rank == 0:  # the (tp 0, replica 0) chain of stages is rank 0's pipeline group
        dist.send(full, dst=0)
    elif dist.get_rank() == 0:
        full = torch.empty(hw.full_shape(name, g), dtype=dtype, device=device)
        dist.recv(full, src=layout.pp_ranks[stage])
        return full
    return None
