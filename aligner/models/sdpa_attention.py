"""A fused core attention for megatron's local layer spec: torch's `scaled_dot_product_attention`.

megatron's local `DotProductAttention` materialises every [s, s] score, masks it with -10000, then
softmaxes and multiplies in separate ops. torch's fused kernel (flash attention on CPU and GPU, or
its memory-efficient kernel for a masked GPU call) does the same maths in one pass: on the tiny CPU
model it is ~3x faster forward and ~1.5x forward + backward, and equal to ~1e-6. It takes megatron's
arguments: `attention_mask` None means causal; otherwise a bool mask [b, 1, s_q, s_k], True where
attention is NOT allowed (packed rows, `aligner.data.packing.tree_attention_mask`), or a
`BlockDiagonalMask` (flat packed rows: independent blocks of one row, each attended on its own, so
no work is spent on the all-masked space between blocks). Grouped-query attention is handled by the
kernel (no repeated keys), except in masked calls, whose keys are repeated (`FusedCoreAttention._attend`).

Not covered, so `use_fused_attention` leaves such layers alone: attention dropout (megatron draws it
from its tensor-parallel RNG tracker), context parallelism (`cp_attention.py`) and the
Transformer-Engine spec (TE has its own fused attention).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule

from aligner.data.packing import tree_attention_mask


@dataclass
class BlockDiagonalMask:
    """Attention inside consecutive blocks of a row: block i is positions bounds[i]..bounds[i+1]-1
    with its own bool mask allowed[i] [b, 1, n_i, n_i] (True where attention IS allowed, torch's
    convention, unlike megatron's masks), or None when the block is one sequence (plain causal
    attention); no position attends outside its block. Passed through megatron as the
    `attention_mask`.

    The causal blocks are attended together, a few kernel calls instead of one per block (RL's
    micro-batches are dozens of short samples, one block each): `causal_groups` pads blocks of similar
    size at their end to the group's longest. Causality keeps a block's real queries off its padding
    keys, so the padding changes nothing but the work of the padded queries, whose outputs are dropped."""

    bounds: list[int]
    allowed: list[torch.Tensor | None]
    _plans: dict = field(default_factory=dict, repr=False)  # device -> causal_groups' plan

    @classmethod
    def from_tree(cls, segments: torch.Tensor, parents: torch.Tensor, bounds: list[int]) -> "BlockDiagonalMask":
        """Each block's `tree_attention_mask` (block ids as in `aligner.data.packing`), None for a block
        of one segment (the whole row's segment changes are found in one pass)."""
        changes = (segments[:, 1:] != segments[:, :-1]).any(0).nonzero().flatten().add(1).tolist()

        def one_segment(start, end):  # no segment change in start + 1 .. end - 1
            i = bisect.bisect_right(changes, start)
            return i == len(changes) or changes[i] >= end

        return cls(list(bounds), [None if one_segment(a, e) else ~tree_attention_mask(segments[:, a:e], parents[:, a:e])
                                  for a, e in zip(bounds, bounds[1:])])

    def causal_groups(self, device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """([(gather [m, L] row positions, kept [r] indices of its real slots, flat) per group of causal blocks], the
        permutation that puts the groups' real outputs, then the other blocks' in row order, back in row order), on
        `device`. A group's blocks are within 4/3 of its longest, so padding at most about doubles a group's
        attention work; its padded slots repeat each block's last position. Computed once per mask and device,
        as index tensors: every layer reuses them, with no host-to-GPU copy or boolean indexing (each a sync)."""
        if device not in self._plans:
            spans = list(zip(self.bounds, self.bounds[1:]))
            blocks = sorted(((e - a, a) for (a, e), mask in zip(spans, self.allowed) if mask is None), reverse=True)
            groups, order = [], []
            while blocks:
                longest = blocks[0][0]
                size = next((i for i, (n, _) in enumerate(blocks) if 4 * n < 3 * longest), len(blocks))
                members, blocks = blocks[:size], blocks[size:]
                steps = torch.arange(longest)
                starts = torch.tensor([a for _, a in members])
                sizes = torch.tensor([n for n, _ in members])
                gather = starts[:, None] + torch.minimum(steps[None, :], sizes[:, None] - 1)
                kept = (steps[None, :] < sizes[:, None]).flatten().nonzero().flatten()
                groups.append((gather.to(device), kept.to(device)))
                order.append(gather.flatten()[kept])
            order += [torch.arange(a, e) for (a, e), mask in zip(spans, self.allowed) if mask is not None]
            self._plans[device] = (groups, torch.cat(order).argsort().to(device))
        return self._plans[device]


class FusedCoreAttention(MegatronModule):
    """Drop-in `core_attention`: q [s, b, heads, d], k and v [s, b, groups, d] -> [s, b, heads * d]."""

    def __init__(self, config, softmax_scale: float | None = None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        # Set by `aligner.models.read_positions.read_only` on the final layer: the positions of a flat
        # packed row whose output is read; the output has one row each. A row of causal blocks only is
        # attended whole in its grouped calls and the read rows taken; otherwise only their queries are attended.
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
                if all(allowed is None for allowed in attention_mask.allowed):
                    # every block causal (RL's samples, a block each): the few grouped calls over every row,
                    # then the read rows, cost far less than a masked call per block on its read rows
                    rows = torch.tensor(self.read_rows, device=query.device)
                    return self._attend_blocks(query, key, value, attention_mask, blocks).index_select(0, rows)
                return self._attend_read_rows(blocks, bounds)
            if all(allowed is not None for allowed in attention_mask.allowed):
                return torch.cat([self._attend(q, k, v, allowed) for q, k, v, allowed in blocks])
            return self._attend_blocks(query, key, value, attention_mask, blocks)
        return self._attend(query, key, value, None if attention_mask is None else ~attention_mask)

    def _attend_blocks(self, query, key, value, mask: BlockDiagonalMask, blocks):
        """A flat row's attention: its causal blocks in `causal_groups`' batched calls, the others one by
        one; the outputs put back in row order."""
        groups, to_rows = mask.causal_groups(query.device)
        _, b, heads, dim = query.shape
        outputs = []
        for gather, kept in groups:
            m, longest = gather.shape
            # [m * L, b, ...] -> [L, m * b, ...]: each block a batch row of its own
            q, k, v = (x.index_select(0, gather.flatten()).view(m, longest, b, *x.shape[2:]).transpose(0, 1)
                       .reshape(longest, m * b, *x.shape[2:]) for x in (query, key, value))
            out = self._attend(q, k, v, None).view(longest, m, b, heads * dim).transpose(0, 1)
            outputs.append(out.reshape(m * longest, b, heads * dim).index_select(0, kept))
        outputs += [self._attend(q, k, v, allowed) for q, k, v, allowed in blocks if allowed is not None]
        return torch.cat(outputs).index_select(0, to_rows)

    def _attend_read_rows(self, blocks, bounds):
        """The flat row's attention at the positions `read_rows` only -> [len(read_rows), 1, heads * d]."""
        rows, outputs = self.read_rows, []
        for (q, k, v, allowed), start, end in zip(blocks, bounds, bounds[1:]):
            mine = rows[bisect.bisect_left(rows, start):bisect.bisect_left(rows, end)]
            mine = torch.tensor(mine, device=q.device) - start
            if mine.numel():
                if allowed is None:  # a causal block: key j is allowed to query i when j <= i
                    allowed = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()[None, None]
                outputs.append(self._attend(q.index_select(0, mine), k, v, allowed[:, :, mine]))
        if not outputs:
            return q.new_zeros(0, 1, q.shape[2] * q.shape[3])
        return torch.cat(outputs)

    def _attend(self, query, key, value, allowed):
        s, b, heads, dim = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        grouped = key.shape[2] != heads
        if grouped and allowed is not None:
            # a masked call with grouped keys would fall back to CUDA's math kernel (its grouped-query support is
            # flash's, which takes no mask), materialising fp32 [b, heads, s, s] scores: repeat the keys instead,
            # for the memory-efficient kernel
            k, v = (x.repeat_interleave(heads // key.shape[2], dim=1) for x in (k, v))
            grouped = False
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=self.softmax_scale, enable_gqa=grouped)
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
