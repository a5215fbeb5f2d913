"""Portable context-parallel core attention for megatron's local layer spec.

megatron-core's only CP kernels live in Transformer Engine (CUDA). This module gives the local
spec a CP path that runs anywhere (gloo on CPU, NCCL on GPU): every CP rank all-gathers K and V
over the CP group, restores megatron's load-balanced chunk order (rank r holds chunks r and
2*CP-1-r of the sequence, see `megatron.core.utils.get_batch_on_this_cp_rank`) and applies the
causal mask for its own query positions. Memory is O(full sequence) per rank: it is the
correctness path, TE's ring attention is the fast path.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule

from aligner.runtime import collectives


class _AllGatherSequence(torch.autograd.Function):
    """all-gather along dim 0; backward sums the gradient over the group and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        return torch.cat(collectives.all_gather(x, group=group), 0)

    @staticmethod
    def backward(ctx, grad):
        grad = collectives.all_reduce(grad.contiguous(), group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.rows
        return grad[start:start + ctx.rows], None


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two sequence chunks (out of 2*CP) that a CP rank holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def positions_on_rank(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token positions held by a CP rank, in its local order."""
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(cp_size, cp_rank)])


class AllGatherContextParallelAttention(MegatronModule):
    """Drop-in `core_attention`: q, k, v [s_local, b, heads, dim] -> [s_local, b, heads * dim]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, **kwargs):
        super().__init__(config=config)
        if (config.attention_dropout if attention_dropout is None else attention_dropout) > 0:
            raise ValueError("the portable context-parallel attention has no dropout; set model.attention_dropout=0")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences with the portable CP attention")
        group = ps.get_context_parallel_group()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        local_len, batch, heads, dim = query.shape
        seq_len = local_len * cp
        # Gathered rows arrive rank by rank; put them back in global sequence order.
        gathered_order = torch.cat([positions_on_rank(seq_len, cp, r) for r in range(cp)])
        to_global = torch.argsort(gathered_order)
        key = _AllGatherSequence.apply(key, group)[to_global]
        value = _AllGatherSequence.apply(value, group)[to_global]
        if key.shape[2] != heads:  # grouped-query attention
            key = key.repeat_interleave(heads // key.shape[2], dim=2)
            value = value.repeat_interleave(heads // value.shape[2], dim=2)
        q_pos = positions_on_rank(seq_len, cp, rank).to(query.device)
        future = torch.arange(seq_len, device=query.device)[None, :] > q_pos[:, None]
        if attention_mask is not None:  # packed rows: [b, 1, s_local, s] (True = masked), this rank's queries
            future = future | attention_mask
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.softmax_scale
        probs = scores.masked_fill(future, float("-inf")).softmax(-1).to(value.dtype)
        context = torch.einsum("bhst,tbhd->sbhd", probs, value)
        return context.reshape(local_len, batch, heads * dim)
