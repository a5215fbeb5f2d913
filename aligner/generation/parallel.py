"""Where this rank sits in the model-parallel (TP x PP) group during generation, and its messages.

One rank per model replica samples: TP rank 0 of the last pipeline stage (the "sampler"). It
broadcasts each step's tokens to the whole TP x PP group, so every rank feeds the same tokens and
applies the same stop rules. Pipeline stages pass hidden states with plain send/recv, one stage
after the other per step (no micro-batching: a decode step is one token per sample).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.runtime import collectives


@dataclass
class StageLayout:
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    prev_rank: int | None  # global rank of the previous / next pipeline stage
    next_rank: int | None
    sampler: int  # global rank of the sampler of this replica
    group: object  # the TP x PP process group (None when it has one rank)
    tp_group: object

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_sampler(self) -> bool:
        return self.group is None or dist.get_rank() == self.sampler

    @classmethod
    def current(cls) -> "StageLayout":
        """From megatron's parallel state (collective over the TP x PP group on first use). Context
        parallelism plays no part: each CP rank is a replica of its own (it holds its TP shard's whole
        weights) and generates whole sequences (MegatronEngine)."""
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        if tp * pp == 1:
            return cls(1, 0, 1, 0, None, None, dist.get_rank() if dist.is_initialized() else 0, None, None)
        group = ps.get_model_parallel_group()
        members = collectives.all_gather_object((pp_rank, tp_rank, dist.get_rank()), group=group)
        sampler = next(rank for p, t, rank in members if p == pp - 1 and t == 0)
        return cls(tp, tp_rank, pp, pp_rank,
                   ps.get_pipeline_model_parallel_prev_rank() if pp_rank > 0 else None,
                   ps.get_pipeline_model_parallel_next_rank() if pp_rank < pp - 1 else None,
                   sampler, group, ps.get_tensor_model_parallel_group() if tp > 1 else None)

    def send_next(self, tensor: torch.Tensor) -> None:
        collectives.send(tensor, dst=self.next_rank)

    def recv_prev(self, shape, dtype, device) -> torch.Tensor:
        return collectives.recv(torch.empty(shape, dtype=dtype, device=device), src=self.prev_rank)

    def from_sampler(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast `tensor` (same shape and dtype on every rank) from the sampler, in place."""
        if self.group is not None:
            collectives.broadcast(tensor, src=self.sampler, group=self.group)
        return tensor

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            collectives.all_reduce(tensor, group=self.tp_group)
        return tensor

    def tp_all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on each TP rank -> [..., n * TP] in rank order."""
        if self.tp == 1:
            return tensor
        rows = tensor.reshape(-1, tensor.shape[-1])
        parts = collectives.all_gather_into_tensor(rows, group=self.tp_group)
        whole = parts.view(self.tp, *rows.shape).permute(1, 0, 2).reshape(rows.shape[0], -1)
        return whole.view(*tensor.shape[:-1], whole.shape[-1])
