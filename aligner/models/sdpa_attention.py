"""A fused core attention for megatron's local layer spec: torch's `scaled_dot_product_attention`.

megatron's local `DotProductAttention` materialises every [s, s] score, masks it with -10000, then
softmaxes and multiplies in separate ops. torch's fused kernel (flash attention on CPU and GPU, or
its memory-efficient kernel for a masked GPU call) does the same maths in one pass: on the tiny CPU
model it is ~3x faster forward and ~1.5x forward + backward, and equal to ~1e-6. It takes megatron's
arguments: `attention_mask` None means causal; otherwise a bool mask [b, 1, s_q, s_k], True where
attention is NOT allowed (packed rows, `aligner.data.packing.tree_attention_mask`), or a
`BlockDiagonalMask` (flat packed rows: independent blocks of one row, each attended on its own, so
no work is spent on the all-masked space between blocks). Grouped-query attention is handled by the
kernel (no repeated keys).

Not covered, so `use_fused_attention` leaves such layers alone: attention dropout (megatron draws it
from its tensor-parallel RNG tracker), context parallelism (`cp_attention.py`) and the
Transformer-Engine spec (TE has its own fused attention).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule

from aligner.data.packing import tree_attention_mask


@dataclass
class BlockDiagonalMask:
    """Attention inside consecutive blocks of a row: block i is positions bounds[i]..bounds[i+1]-1
    with its own bool mask allowed[i] [b, 1, n_i, n_i] (True where attention IS allowed, torch's
    convention, unlike megatron's masks); no position attends outside its block. Passed through
    megatron as the `attention_mask`."""

    bounds: list[int]
    allowed: list[torch.Tensor]

    @classmethod
    def from_tree(cls, segments: torch.Tensor, parents: torch.Tensor, bounds: list[int]) -> "BlockDiagonalMask":
        """Each block's `tree_attention_mask` (block ids as in `aligner.data.packing`)."""
        return cls(list(bounds), [~tree_attention_mask(segments[:, a:e], parents[:, a:e])
                                  for a, e in zip(bounds, bounds[1:])])


class FusedCoreAttention(MegatronModule):
    """Drop-in `core_attention`: q [s, b, heads, d], k and v [s, b, groups, d] -> [s, b, heads * d]."""

    def __init__(self, config, softmax_scale: float | None = None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        # Set by `aligner.models.read_positions.read_only` on the final layer: the positions of a flat
        # packed row whose output is read. Only their queries are then attended (one output row each).
        self.read_rows: list[int] | None = None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("FusedCoreAttention takes neither packed_seq_params nor attention_bias")
        if isinstance(attention_mask, BlockDiagonalMask):
            bounds = attention_mask.bounds
            sizes = [e - a for a, e in zip(bounds, bounds[1:])]
            # split, not slices: its backward is one concatenation, where each slice's would be a
            # zero-filled full-length gradient to add up
            blocks = zip(*(x.split(sizes) for x in (query, key, value)), attention_mask.allowed)
            if self.read_rows is not None and query.shape[1] == 1:
                return self._attend_read_rows(blocks, bounds)
            return torch.cat([self._attend(q, k, v, allowed) for q, k, v, allowed in blocks])
        return self._attend(query, key, value, None if attention_mask is None else ~attention_mask)

    def _attend_read_rows(self, blocks, bounds):
        """The flat row's attention at the positions `read_rows` only -> [len(read_rows), 1, heads * d]."""
        rows, outputs = self.read_rows, []
        for (q, k, v, allowed), start, end in zip(blocks, bounds, bounds[1:]):
            mine = rows[bisect.bisect_left(rows, start):bisect.bisect_left(rows, end)]
            mine = torch.tensor(mine, device=q.device) - start
            if mine.numel():
                outputs.append(self._attend(q.index_select(0, mine), k, v, allowed[:, :, mine]))
        if not outputs:
            return q.new_zeros(0, 1, q.shape[2] * q.shape[3])
        return torch.cat(outputs)

    def _attend(self, query, key, value, allowed):
        s, b, heads, dim = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=self.softmax_scale,
            enable_gqa=key.shape[2] != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)


def all_fused(model) -> bool:
    """Whether every attention layer of `model` is a `FusedCoreAttention` (takes a `BlockDiagonalMask`)."""
    layers = [getattr(layer, "self_attention", None) for layer in model.decoder.layers]
    return bool(layers) and all(isinstance(getattr(a, "core_attention", None), FusedCoreAttention) for a in layers)


def use_fused_attention(gpt) -> int:
    """Replace megatron's local `DotProductAttention` in every layer of `gpt` by `FusedCoreAttention`
    (it holds no weights, so checkpoints do not change), unless attention dropout, query-key layer
    scaling or a sliding window is on. Returns how many layers were changed."""
    config = gpt.config
    if config.attention_dropout > 0 or config.apply_query_key_layer_scaling or config.window_size is not None:
        return 0
    changed = 0
    for layer in gpt.decoder.layers:
        attention = getattr(layer, "self_attention", None)
        core = getattr(attention, "core_attention", None)
        if type(core) is DotProductAttention and core.config.softmax_type == "vanilla":
            attention.core_attention = FusedCoreAttention(core.config, core.softmax_scale)
            changed += 1
    return changed
