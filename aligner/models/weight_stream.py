"""Stream a (TP/PP-sharded) megatron GPT as full Hugging Face tensors, a bucket at a time.

`iter_hf_weights` is collective: every rank of the job calls it and iterates it to the end in step.
It walks the model in HF order (embedding, layer 0..L-1, final norm, head) and every rank makes the
same collective calls, in the same order and with the same shapes, whatever it holds, so that no rank
can wait on a call its peers skip. For each parameter, owned by pipeline stage s:
  1. (PP > 1) stage s broadcasts its TP shard over each pipeline group: every stage now holds that
     shard, in the TP column it belongs to (a replicated parameter: the whole, from each column);
  2. (TP > 1, a TP-split parameter) every stage all-gathers the shards over its TP group.
Every rank then has the full tensor; the receivers (global rank 0, or every rank with
`all_ranks=True`) convert it to HF tensors and keep it in the bucket, the others drop it at once.
Every data-/context-parallel replica does the same within its own groups.
The cost over the minimum, when only rank 0 needs the tensors: the other stages' TP gathers and the
other replicas' calls, all concurrent with rank 0's own on links that would otherwise be idle; the
pipeline hop carries 1/TP of each tensor per TP column instead of the whole tensor on one.
At most one bucket of full tensors exists at a time (plus one parameter's on the other ranks), so
exporting or refitting a 70B model never needs a second full copy. Every rank yields the same number
of buckets; ranks that are not receivers get empty dicts, so callers may run their own collectives
per bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.models import hf_weights as hw
from aligner.models import lora
from aligner.runtime import collectives

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


def _local_parameters(model, g: hw.Geometry, offset: int, expected: list[str]) -> dict[str, Callable]:
    """canonical name -> a function giving this rank's tensor: the parameter, or for a linear with a LoRA
    adapter its merged weight, made when streamed (one at a time, never a merged copy of the model)."""
    local, modules = {}, dict(model.named_modules())
    for name, param in model.named_parameters():
        if lora.is_adapter_parameter(name):
            continue
        canonical = hw.canonical_name(name, offset)
        if canonical == "output_layer.weight" and g.tied and not g.score_outputs:
            continue  # the last stage's copy of the tied embedding
        owner, _, leaf = name.rpartition(".")
        local[canonical] = (functools.partial(lora.merged_weight, modules[owner]) if leaf == "weight"
                            else (lambda p=param: p))
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
    tp_group: object
    pp_group: object
    pp_ranks: tuple  # global ranks of this rank's pipeline group, by stage

    @classmethod
    def current(cls) -> "_Layout":
        pp_group = ps.get_pipeline_model_parallel_group()
        pp_ranks = tuple(dist.get_process_group_ranks(pp_group)) if ps.get_pipeline_model_parallel_world_size() > 1 \
            else (dist.get_rank(),)
        return cls(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(), tp_group=ps.get_tensor_model_parallel_group(),
                   pp_group=pp_group, pp_ranks=pp_ranks)


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
            full = _full_tensor(name, local.get(name), stage, layout, g, dtype, device)
            if receiver:
                bucket.update(hw.to_hf(name, full, g))
    yield bucket


def _gathered(name: str, g: hw.Geometry, tp: int) -> bool:
    """Whether the parameter is split over TP (the scalar head is replicated)."""
    scalar_head = g.score_outputs and name == "output_layer.weight"
    return tp > 1 and hw.split_rule(name) is not None and not scalar_head


def _part_shape(name: str, g: hw.Geometry, tp: int) -> tuple[int, ...]:
    """The shape of one TP rank's part of a parameter."""
    shape = list(hw.full_shape(name, g))
    if _gathered(name, g, tp):
        rule = hw.split_rule(name)
        shape[0 if rule == "glu" else rule] //= tp
    return tuple(shape)


def _full_tensor(name, local, stage, layout: _Layout, g, dtype, device) -> torch.Tensor:
    """The full (TP-gathered) tensor of a parameter of pipeline stage `stage`, on every rank; the
    calls (module doc) depend only on the name, the geometry and the layout, never on `local`
    (this rank's tensor, when it holds the parameter)."""
    shape = _part_shape(name, g, layout.tp)
    if layout.pp_rank == stage:
        part = local().detach().to(dtype).contiguous()
        if tuple(part.shape) != shape:
            raise RuntimeError(f"{name}: local shape {tuple(part.shape)}, the layout expects {shape}")
    else:
        part = torch.empty(shape, dtype=dtype, device=device)
    if len(layout.pp_ranks) > 1:
        collectives.broadcast(part, src=layout.pp_ranks[stage], group=layout.pp_group)
    if not _gathered(name, g, layout.tp):
        return part
    return hw.unshard(name, collectives.all_gather(part, group=layout.tp_group))
