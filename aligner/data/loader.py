"""Global batches: which samples each optimizer step uses, and how they become tensors.

Conventions:
* `GlobalBatchSampler` walks epochs forever. Epoch e is a permutation of range(num_samples) drawn from
  `numpy.random.RandomState([seed, e])` (the identity without shuffle), cut into
  `num_samples // global_batch_size` batches; the incomplete tail of every epoch is skipped, so every
  step sees exactly `global_batch_size` samples. Its state (`consumed_samples`, `epoch`, the offset in the
  epoch) restores the exact position; the global batch size may change across a restore, the data may not.
* `collate` does the next-token shift: `tokens = ids[:-1]`, `labels = ids[1:]`, `loss_mask = loss_mask[1:]`,
  right-padded to `length` with `pad_id` (tokens and labels) and 0 (loss mask).
* A global batch is split over data-parallel ranks in contiguous slices, rank 0 first.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if num_samples < global_batch_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch "
                             f"({global_batch_size}); lower the global batch size or add data")
        if not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.consumed_samples, self.epoch, self.offset = 0, 0, 0  # offset: samples used in this epoch
        self._order, self._order_epoch = None, None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                self._order = np.random.RandomState([self.seed, self.epoch]).permutation(self.num_samples)
            else:
                self._order = np.arange(self.num_samples)
            self._order_epoch = self.epoch
        return self._order

    def next_global_batch(self) -> list[int]:
        """The sample indices of the next step (exactly `global_batch_size` of them)."""
        if self.offset + self.global_batch_size > self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0
        batch = self._epoch_order()[self.offset:self.offset + self.global_batch_size]
        self.offset += self.global_batch_size
        self.consumed_samples += self.global_batch_size
        return batch.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_global_batch()

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "epoch": self.epoch, "epoch_offset": self.offset,
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the sampler: it was saved with {key}={state[key]}, "
                                 f"now {key}={getattr(self, key)}")
        self.consumed_samples, self.epoch = state["consumed_samples"], state["epoch"]
        self.offset = state["epoch_offset"]


def pad_length(samples: Sequence, multiple: int = 1) -> int:
    """The collated length for `samples`: the longest `len(ids) - 1`, rounded up to a multiple of `multiple`."""
    longest = max(len(s.ids) - 1 for s in samples)
    return max(-(-longest // multiple) * multiple, multiple)


def collate(samples: Sequence, pad_id: int, length: int) -> dict[str, torch.Tensor]:
    """`tokens`, `labels` (int64) and `loss_mask` (float32), each [len(samples), length], shifted and padded."""
    tokens = torch.full((len(samples), length), pad_id, dtype=torch.int64)
    labels = torch.full((len(samples), length), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((len(samples), length), dtype=torch.float32)
    for row, s in enumerate(samples):
        n = len(s.ids) - 1
        if n > length:
            raise ValueError(f"sample {row} has {n} positions after the shift, more than length={length}")
        tokens[row, :n] = torch.tensor(s.ids[:-1], dtype=torch.int64)
        labels[row, :n] = torch.tensor(s.ids[1:], dtype=torch.int64)
        loss_mask[row, :n] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def split_for_rank(items: Sequence, dp_rank: int, dp_size: int) -> Sequence:
    """This data-parallel rank's contiguous slice of a global batch (indices or samples)."""
    if len(items) % dp_size:
        raise ValueError(f"a global batch of {len(items)} does not split evenly over {dp_size} data-parallel ranks")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
    per_rank = len(items) // dp_size
    return items[dp_rank * per_rank:(dp_rank + 1) * per_rank]
