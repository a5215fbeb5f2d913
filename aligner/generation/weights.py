"""Engine weights: load a weight stream into a (TP/PP-sharded) GPTModel, and compare with the trainer's.

A weight stream is an iterable of {name: tensor} buckets. Two naming schemes are accepted, mixed freely:
  * this rank's own parameter names (`model.named_parameters()`), tensors of the local shard's shape;
  * Hugging Face names with full tensors, as `aligner.models.weight_stream.iter_hf_weights(...,
    all_ranks=True)` yields them; every rank takes the parts of the parameters it holds
    (`aligner.models.hf_weights` does the layout mapping and the TP split).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from megatron.core import parallel_state as ps

from aligner.models import hf_weights as hw
from aligner.models.gpt import layer_offset
from aligner.runtime import collectives


@torch.no_grad()
def load_weight_stream(model, stream: Iterable[Mapping[str, torch.Tensor]], model_cfg, vocab_size: int) -> int:
    """Copy every tensor of `stream` into `model` (a GPTModel stage); returns how many parameters were set."""
    params = dict(model.named_parameters())
    hf = None
    loaded = set()
    for bucket in stream:
        foreign = {}
        for name, tensor in bucket.items():
            if name in params:
                _copy(params[name], tensor, name)
                loaded.add(name)
            else:
                foreign[name] = tensor
        if foreign:
            hf = hf or _HFLoader(model, params, model_cfg, vocab_size)
            loaded |= hf.add(foreign)
    if hf is not None:
        hf.finish()
    return len(loaded)


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tensor.shape != param.shape:
        raise ValueError(f"weight stream: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(param.shape)}")
    param.copy_(tensor)


class _HFLoader:
    """Hugging Face named buckets -> this rank's parameter shards (parts may arrive in any bucket)."""

    def __init__(self, model, params, model_cfg, vocab_size):
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.geometry = hw.Geometry.of(model_cfg, vocab_size, self.tp)
        offset = layer_offset(model_cfg)
        # canonical name -> (local parameter, HF names it is made of), for what this rank holds
        self.waiting = {}
        for name, param in params.items():
            canonical = hw.canonical_name(name, offset)
            self.waiting[canonical] = (param, hw.hf_names(canonical, self.geometry))
        self.known = {n for c in hw.mcore_names(self.geometry) for n in hw.hf_names(c, self.geometry)}
        self.parts: dict[str, torch.Tensor] = {}

    def add(self, bucket: Mapping[str, torch.Tensor]) -> set:
        unknown = sorted(set(bucket) - self.known)
        if unknown:
            raise ValueError(f"weight stream: unknown parameter names {unknown[:5]}")
        needed = {n for _, names in self.waiting.values() for n in names}
        self.parts.update({n: t for n, t in bucket.items() if n in needed})
        done = set()
        for canonical, (param, names) in list(self.waiting.items()):
            if all(n in self.parts for n in names):
                full = hw.from_hf(canonical, self.parts.__getitem__, self.geometry)
                _copy(param, hw.shard(canonical, full, self.tp, self.tp_rank).to(param.dtype), canonical)
                del self.waiting[canonical]
                done.add(canonical)
        still = {n for _, names in self.waiting.values() for n in names}
        self.parts = {n: t for n, t in self.parts.items() if n in still}
        return done

    def finish(self) -> None:
        if self.waiting:
            raise ValueError(f"weight stream ended without {sorted(self.waiting)[:5]}")


_VOCAB_ROWS = ("word_embeddings.weight", "output_layer.weight")


def _true_rows(name: str, tensor: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Drop megatron's vocabulary padding rows (never read) from an embedding / output shard."""
    if vocab_size is None or not name.endswith(_VOCAB_ROWS):
        return tensor
    start = ps.get_tensor_model_parallel_rank() * tensor.shape[0]
    return tensor[: max(0, min(tensor.shape[0], vocab_size - start))]


@torch.no_grad()
def compare_weights(engine_model, trainer_model, vocab_size: int | None = None) -> dict:
    """Largest |engine - trainer| over every parameter of every rank (collective when distributed);
    with `vocab_size`, the vocabulary padding rows are left out (they never affect a token).

    Returns {"shared": all parameters are the same storage, "bitwise": all equal bit for bit,
    "max_abs_diff": float, "params": number of local parameters compared}.
    """
    mine, theirs = dict(engine_model.named_parameters()), dict(trainer_model.named_parameters())
    if mine.keys() != theirs.keys():
        raise ValueError(f"engine and trainer models differ in parameters: "
                         f"{sorted(mine.keys() ^ theirs.keys())[:5]}")
    shared, unequal, worst = 1.0, 0.0, 0.0
    for name, p in mine.items():
        q = theirs[name]
        same_storage = p.data_ptr() == q.data_ptr() and p.shape == q.shape and p.dtype == q.dtype
        shared = min(shared, float(same_storage))
        if not same_storage:
            p, q = _true_rows(name, p, vocab_size), _true_rows(name, q, vocab_size)
            unequal = max(unequal, float(p.dtype != q.dtype or not torch.equal(p, q.to(p.dtype))))
            worst = max(worst, (p.float() - q.float()).abs().max().item() if p.numel() else 0.0)
    stats = torch.tensor([1.0 - shared, unequal, worst], dtype=torch.float64)
    if collectives.several_ranks():
        collectives.all_reduce(stats, op=collectives.ReduceOp.MAX)
    return {"shared": stats[0].item() == 0.0, "bitwise": stats[1].item() == 0.0,
            "max_abs_diff": stats[2].item(), "params": len(mine)}
