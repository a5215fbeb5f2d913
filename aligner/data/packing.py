"""Micro-batches of token sequences: padded (one sequence per row) or packed (several per row), with
the common prefix of a preference pair computed once when packed.

A sequence is `(ids, mask)`: token ids and an equally long 0/1 mask of the tokens that are trained
on (the SFT convention, `aligner.data.sft`). As in SFT, the model reads `ids[:-1]` and predicts
`ids[1:]`, so a sequence of n tokens takes n - 1 positions; position t has label `ids[t+1]` and loss
mask `mask[t+1]`.

`build_micro_batches(groups, ...)` turns a step's micro-batches (`groups`, lists of sequences) into
tensors that share one shape [rows, length] (pipeline parallelism sends fixed shapes through a step):
* padded: a row per sequence, right-padded; `length` = the longest sequence, rounded up to `multiple`.
* packed: the micro-batch's units are placed into rows of at most `capacity` positions by first-fit
  decreasing (deterministic); every micro-batch gets the step's largest row count (extra rows are
  empty) and `length` = the fullest row, rounded up to `multiple`. A unit is one sequence or, with
  `pairs=True` (the sequences are [chosen_0..chosen_{p-1}, rejected_0..rejected_{p-1}]), a pair tree:
  the pair's common leading positions (the prompt, and any identical start of the two responses)
  once as a trunk, then the chosen branch, then the rejected branch. Both branches attend to the
  trunk and to themselves, never to each other, and their positions continue from the trunk's, so
  every sequence sees exactly the context it would see alone. The trunk stops one position short of
  the first differing token, since that position predicts different labels for the two sequences.
With `flat=True` (packed only) a micro-batch is a single row: its bins follow one another with no
padding in between (the linear layers, most of the compute, see no padding) and `length` = the
fullest micro-batch, rounded up to `multiple`. `blocks` lists the boundaries of its attention blocks
(plus the end of the tail padding, a block of its own); attention never crosses a boundary, so each
block is attended on its own (`aligner.models.sdpa_attention.BlockDiagonalMask`). A block is a run
of consecutive units of one bin, closed once it holds `MIN_ATTENTION_BLOCK` positions: attention
costs the square of a block's size, so a bin of 256 positions attended as three units of ~85 costs
about half, while blocks much smaller than that would pay the kernel's fixed price per call (blocks
of one sequence, such as RL's samples, are attended several to a call, padded to similar sizes).
Each micro-batch dict holds, all [rows, length]: `tokens`, `labels` (int64), `loss_mask` (float32),
`sequence_index` (which of the micro-batch's sequences a position's label belongs to, -1 on padding),
`shared_index` (a second sequence the label also belongs to: a trunk position counts for both
sequences of its pair; else -1), `position_ids` (the position inside its sequence), `segments` and
`parents` (block ids for `tree_attention_mask`), plus `num_sequences`, `packed` and, when flat,
`blocks`.

Positions: megatron's GPTModel applies rotary embeddings by row position and ignores `position_ids`
unless it is built for explicit positions (`aligner.models.policy.with_token_positions`);
packed batches need that model, padded ones work with either.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

TokenSequence = tuple[Sequence[int], Sequence[int]]  # (ids, mask)
# Positions from which a unit run becomes its own attention block in a flat row. Measured on CPU
# (4 heads of 32, forward + backward): a call costs ~80 us up to ~16 positions, 110 us at 32, 200 us at
# 64, 330 us at 85, 1.8 ms at 256.
MIN_ATTENTION_BLOCK = 64
KEYS = ("tokens", "labels", "loss_mask", "sequence_index", "shared_index", "position_ids", "segments", "parents")


@dataclass
class Unit:
    """Positions placed together in one row: a sequence, or a pair tree. `segments`/`parents` are
    local block ids (0, 1, ...); a position may attend to earlier positions of its own block and of
    its parent block."""

    tokens: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    sequence_index: list = field(default_factory=list)
    shared_index: list = field(default_factory=list)
    position_ids: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    parents: list = field(default_factory=list)

    def add(self, ids, mask, start: int, stop: int, index: int, shared: int, segment: int, parent: int) -> None:
        """Positions start..stop-1 of sequence `ids` (inputs ids[t], labels ids[t+1])."""
        n = stop - start
        self.tokens += ids[start:stop]
        self.labels += ids[start + 1:stop + 1]
        self.loss_mask += mask[start + 1:stop + 1]
        self.sequence_index += [index] * n
        self.shared_index += [shared] * n
        self.position_ids += range(start, stop)
        self.segments += [segment] * n
        self.parents += [parent] * n

    def __len__(self) -> int:
        return len(self.tokens)


def sequence_unit(ids, mask, index: int) -> Unit:
    unit = Unit()
    unit.add(list(ids), list(mask), 0, len(ids) - 1, index, -1, 0, 0)
    return unit


def pair_unit(chosen: TokenSequence, rejected: TokenSequence, chosen_index: int, rejected_index: int) -> Unit:
    (c, cm), (r, rm) = (list(x) for x in chosen), (list(x) for x in rejected)
    common = 0
    while common < min(len(c), len(r)) and c[common] == r[common] and cm[common] == rm[common]:
        common += 1
    trunk = max(min(common, len(c) - 1, len(r) - 1) - 1, 0)  # positions whose labels agree
    unit = Unit()
    unit.add(c, cm, 0, trunk, chosen_index, rejected_index, 0, 0)
    unit.add(c, cm, trunk, len(c) - 1, chosen_index, -1, 1, 0)
    unit.add(r, rm, trunk, len(r) - 1, rejected_index, -1, 2, 0)
    return unit


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths`, each bin's total at most `capacity`: longest first, each into
    the first bin it fits (ties keep the input order; bins list their indices in ascending order)."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a unit of {max(lengths)} positions does not fit in a row of {capacity}")
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


def _units(group: Sequence[TokenSequence], packed: bool, pairs: bool) -> list[Unit]:
    if any(len(ids) < 2 for ids, _ in group):
        raise ValueError("every sequence needs at least 2 tokens (one input and its label)")
    if packed and pairs:
        p = len(group) // 2
        return [pair_unit(group[i], group[p + i], i, p + i) for i in range(p)]
    return [sequence_unit(ids, mask, i) for i, (ids, mask) in enumerate(group)]


def _round_up(n: int, multiple: int) -> int:
    return max(-(-n // multiple) * multiple, multiple)


def build_micro_batches(groups: Sequence[Sequence[TokenSequence]], pad_id: int, packed: bool = False,
                        capacity: int | None = None, multiple: int = 1, pairs: bool = False,
                        flat: bool = False) -> tuple[list[dict], int]:
    """(micro-batch dicts, length) for a step; see the module doc. `capacity` (packed only) is the
    most positions a row (a block, when flat) holds; it is raised to the largest unit of the step
    when smaller."""
    units = [_units(group, packed, pairs) for group in groups]
    longest = max(len(u) for us in units for u in us)
    capacity = max(capacity or longest, longest)
    layouts = [first_fit_decreasing([len(u) for u in us], capacity) if packed else [[i] for i in range(len(us))]
               for us in units]
    if packed and flat:
        length = _round_up(max(sum(len(u) for u in us) for us in units), multiple)
        batches = []
        for us, layout in zip(units, layouts):
            batch = _fill(us, [[i for row in layout for i in row]], 1, length, pad_id)
            batch["blocks"] = attention_blocks([[len(us[i]) for i in row] for row in layout], length)
            batches.append(batch)
    else:
        rows = max(len(layout) for layout in layouts)
        fill = max(sum(len(us[i]) for i in row) for us, layout in zip(units, layouts) for row in layout)
        length = _round_up(fill, multiple)
        batches = [_fill(us, layout, rows, length, pad_id) for us, layout in zip(units, layouts)]
    for batch, group in zip(batches, groups):
        batch.update(num_sequences=len(group), packed=packed)
    return batches, length


def attention_blocks(bins: Sequence[Sequence[int]], length: int) -> list[int]:
    """Block boundaries of a flat row holding `bins` (the unit sizes of each, in row order) and tail
    padding up to `length`: runs of consecutive units of a bin, each closed once it holds
    `MIN_ATTENTION_BLOCK` positions or at the bin's end, then the padding."""
    bounds, at = [0], 0
    for sizes in bins:
        for size in sizes:
            at += size
            if at - bounds[-1] >= MIN_ATTENTION_BLOCK:
                bounds.append(at)
        if bounds[-1] != at:
            bounds.append(at)
    return bounds + [length] if at < length else bounds


def _fill(units: list[Unit], layout: list[list[int]], rows: int, length: int, pad_id: int) -> dict:
    """The [rows, length] tensors of `layout` (each row's units, in order), built as Python lists and
    converted once per key (a tensor op per unit and key cost more than the step's optimizer)."""
    fills = {"tokens": pad_id, "labels": pad_id, "sequence_index": -1, "shared_index": -1}
    columns = {k: [] for k in KEYS}
    for members in layout:
        row = {k: [] for k in KEYS}
        blocks = 0
        for unit in (units[i] for i in members):
            for key in KEYS:
                values = getattr(unit, key)
                row[key] += [v + blocks for v in values] if key in ("segments", "parents") else values
            blocks += max(unit.segments) + 1
        pad = length - len(row["tokens"])
        for key in KEYS:
            if key in ("segments", "parents"):
                tail = [blocks] * pad  # padding: one block of its own
            elif key == "position_ids":
                tail = list(range(pad))
            else:
                tail = [fills.get(key, 0)] * pad
            columns[key].append(row[key] + tail)
    for _ in range(rows - len(layout)):  # empty rows: padding only
        for key in KEYS:
            columns[key].append([fills.get(key, 0)] * length)
    return {k: torch.tensor(v, dtype=torch.float32 if k == "loss_mask" else torch.int64) for k, v in columns.items()}


def tree_attention_mask(segments: torch.Tensor, parents: torch.Tensor,
                        query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Attention mask for packed rows, True where attention is NOT allowed (megatron's convention):
    [rows, 1, queries, length]. A query at row position q may attend to key k iff k <= q and k is in
    q's block or in q's parent block (a pair branch sees its trunk). `query_positions` selects the
    query rows (a context-parallel rank's positions); default all."""
    length = segments.shape[1]
    keys = torch.arange(length, device=segments.device)
    queries = keys if query_positions is None else query_positions.to(segments.device)
    future = keys[None, :] > queries[:, None]  # [q, k]
    own = segments[:, queries, None] == segments[:, None, :]  # [rows, q, k]
    parent = parents[:, queries, None] == segments[:, None, :]
    return (future[None] | ~(own | parent)).unsqueeze(1)


def with_response_mask(ids: Sequence[int], start: int) -> TokenSequence:
    """A sequence whose trained tokens are `ids[start:]` (a prompt followed by a response)."""
    return ids, [0] * start + [1] * (len(ids) - start)
