"""Micro-batches of token sequences, padded (one sequence per row) or packed (several per row).

A sequence is `(ids, mask)`: token ids and an equally long 0/1 mask of the tokens that are trained
on (the SFT convention, `aligner.data.sft`). As in SFT, the model reads `ids[:-1]` and predicts
`ids[1:]`, so a sequence of n tokens takes n - 1 positions, and position t has label `ids[t+1]` and
loss mask `mask[t+1]`.

`build_micro_batches(groups, ...)` turns a step's micro-batches (`groups`, lists of sequences) into
tensors that share one shape [rows, length] (pipeline parallelism sends fixed shapes through a step):
* padded: a row per sequence, right-padded; `length` = the longest sequence, rounded up to `multiple`.
* packed: each micro-batch's sequences are placed into rows of at most `capacity` positions by
  first-fit decreasing (deterministic); every micro-batch gets the step's largest row count (extra rows
  are empty) and `length` = the fullest row, rounded up to `multiple`.
Each micro-batch dict holds, all [rows, length]: `tokens`, `labels` (int64), `loss_mask` (float32),
`sequence_index` (which of the micro-batch's sequences a position belongs to, in the order given;
-1 on padding), `segments` (a per-row segment id, -1 on padding), `position_ids` (restarting at 0 in
each sequence), plus `num_sequences` and `packed`. Packed rows need `block_causal_mask`: a position
attends to the earlier positions of its own sequence only, so no token sees another sample.

Why packing is exact with RoPE: megatron's GPTModel applies rotary embeddings by row position and
does not read `position_ids` (only learned absolute embeddings do); since rotary attention scores
depend only on the distance between two positions, a sequence that starts at row offset k gets the
same attention as at offset 0 once the mask isolates it. Packed and padded batches therefore agree
up to float rounding (tests/test_packing.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

TokenSequence = tuple[Sequence[int], Sequence[int]]  # (ids, mask)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths`, each bin's total at most `capacity`: longest first, each into
    the first bin it fits (ties keep the input order; bins list their indices in ascending order)."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} positions does not fit in a row of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


def _round_up(n: int, multiple: int) -> int:
    return max(-(-n // multiple) * multiple, multiple)


def _layout(group: Sequence[TokenSequence], packed: bool, capacity: int) -> list[list[int]]:
    lengths = [len(ids) - 1 for ids, _ in group]
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence needs at least 2 tokens (one input and its label)")
    return first_fit_decreasing(lengths, capacity) if packed else [[i] for i in range(len(group))]


def build_micro_batches(groups: Sequence[Sequence[TokenSequence]], pad_id: int, packed: bool = False,
                        capacity: int | None = None, multiple: int = 1) -> tuple[list[dict], int]:
    """(micro-batch dicts, length) for a step; see the module doc. `capacity` (packed only) is the
    most positions a row holds; it defaults to the longest sequence of the step."""
    longest = max(len(ids) - 1 for group in groups for ids, _ in group)
    capacity = max(capacity or longest, longest)
    layouts = [_layout(group, packed, capacity) for group in groups]
    rows = max(len(layout) for layout in layouts)
    fill = max(sum(len(group[i][0]) - 1 for i in row) for group, layout in zip(groups, layouts) for row in layout)
    length = _round_up(fill, multiple)
    return [_fill(group, layout, rows, length, pad_id, packed) for group, layout in zip(groups, layouts)], length


def _fill(group, layout, rows: int, length: int, pad_id: int, packed: bool) -> dict:
    tokens = torch.full((rows, length), pad_id, dtype=torch.int64)
    labels = torch.full((rows, length), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((rows, length), dtype=torch.float32)
    sequence_index = torch.full((rows, length), -1, dtype=torch.int64)
    segments = torch.full((rows, length), -1, dtype=torch.int64)
    position_ids = torch.zeros((rows, length), dtype=torch.int64)
    for row, members in enumerate(layout):
        at = 0
        for segment, i in enumerate(members):
            ids, mask = group[i]
            n = len(ids) - 1
            span = slice(at, at + n)
            tokens[row, span] = torch.as_tensor(ids[:-1], dtype=torch.int64)
            labels[row, span] = torch.as_tensor(ids[1:], dtype=torch.int64)
            loss_mask[row, span] = torch.as_tensor(mask[1:], dtype=torch.float32)
            sequence_index[row, span] = i
            segments[row, span] = segment
            position_ids[row, span] = torch.arange(n)
            at += n
        position_ids[row, at:] = torch.arange(length - at)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "sequence_index": sequence_index,
            "segments": segments, "position_ids": position_ids, "num_sequences": len(group), "packed": packed}


def block_causal_mask(segments: torch.Tensor, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Attention mask for packed rows, True where attention is NOT allowed (megatron's convention):
    [rows, 1, queries, length]. A query at row position q may attend to key k iff k <= q and both
    are in the same segment (padding, segment -1, attends causally within the padding).
    `query_positions` selects the query rows (a context-parallel rank's positions); default all."""
    length = segments.shape[1]
    keys = torch.arange(length, device=segments.device)
    queries = keys if query_positions is None else query_positions.to(segments.device)
    future = keys[None, :] > queries[:, None]  # [q, k]
    other = segments[:, queries, None] != segments[:, None, :]  # [rows, q, k]
    return (future[None] | other).unsqueeze(1)


def with_response_mask(ids: Sequence[int], start: int) -> TokenSequence:
    """A sequence whose trained tokens are `ids[start:]` (a prompt followed by a response)."""
    return ids, [0] * start + [1] * (len(ids) - start)
