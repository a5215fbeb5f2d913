"""Offline preference optimisation on the shared trainer loop: what DPO, ORPO, SimPO and KTO share
(their losses are in `preference/losses.py`).

A step, for every algorithm:
  global batch -> this DP rank's samples -> micro-batches of token sequences (padded, or packed with
  block-causal attention, `aligner.data.packing`) -> forward-only pre-passes: the frozen reference's
  log-probs (DPO, KTO; `shared/reference.py`) and the policy's log-probs on KTO's mismatched pairs -> the
  training step with the algorithm's loss on per-sequence log-probs (`shared/sequence_logprobs.py`).
Under pipeline parallelism the loss (and the reference log-probs it needs) live on the last stage;
context parallelism is handled by the forward step (`aligner.models.forward_step`).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from megatron.core import parallel_state as ps

from aligner.algorithms.shared.reference import Reference, build_reference, cached_reference
from aligner.algorithms.shared.sequence_logprobs import interleave
from aligner.algorithms.shared.trainer import Trainer
from aligner.data.loader import split_for_rank
from aligner.data.packing import build_micro_batches
from aligner.models.checkpoint import unwrap
from aligner.models import gpt
from aligner.models.sdpa_attention import all_fused

log = logging.getLogger(__name__)


class SequenceObjective:
    """What differs between DPO, ORPO, SimPO and KTO: the sequences a sample trains on, the
    pre-passes that annotate a step's micro-batches, and the loss on per-sequence log-probs."""

    uses_reference = False

    def sequences(self, sample) -> list:
        """The sample's training sequences as (ids, mask); a micro-batch lists sequence j of all its
        samples before sequence j + 1 (DPO: all chosen, then all rejected)."""
        raise NotImplementedError

    def reference_sequences(self, sample) -> list:
        """The sequences whose reference log-probs the loss needs (precomputed per sample)."""
        return self.sequences(sample)

    def annotate(self, trainer: "SequenceTrainer", samples: Sequence, groups: list, micro: list[dict],
                 length: int) -> None:
        """Add what the loss needs to each micro-batch (reference log-probs, rewards, ...)."""

    def loss(self, sums: torch.Tensor, counts: torch.Tensor, batch: dict):
        raise NotImplementedError

    def tokens(self, sample) -> int:
        return sum(len(ids) for ids, _ in self.sequences(sample))


class SequenceFormat:
    """`BatchFormat` of the preference algorithms (the trainer reads `length` and `tokens`; the
    micro-batches themselves are built by `SequenceTrainer`)."""

    def __init__(self, algorithm: SequenceObjective, pad_id: int):
        self.algorithm, self.pad_id = algorithm, pad_id

    def length(self, sample) -> int:
        return max(len(ids) - 1 for ids, _ in self.algorithm.sequences(sample))

    def tokens(self, sample) -> int:
        return self.algorithm.tokens(sample)

    def collate(self, samples, length: int) -> dict:
        seqs = interleave([self.algorithm.sequences(s) for s in samples])
        return build_micro_batches([seqs], self.pad_id)[0][0]


class SequenceTrainer(Trainer):
    """The shared loop with preference micro-batches (padded or packed) and the algorithm's
    pre-passes before each step; builds the reference at resume."""

    def __init__(self, *args, algorithm: SequenceObjective, reference_mode: str | None, packing: dict,
                 **kwargs):
        super().__init__(*args, **kwargs)
        flat = flat_packing(packing["packed"], self.model)
        self.algorithm, self.reference_mode, self.packing = algorithm, reference_mode, {**packing, "flat": flat}
        self.reference: Reference | None = None

    def resume(self) -> None:
        if self.algorithm.uses_reference:
            m = self.cfg.model
            self.reference = build_reference(self.cfg, self.model, self.vocab_size,
                                             "cpu_swap" if self.reference_mode == "precompute" else self.reference_mode)
            if self.reference_mode == "precompute":
                reference_id = f"{m.pretrained or f'init seed={self.cfg.trainer.seed}'} {dict(m)}"
                common = (self.reference, self.algorithm.reference_sequences, reference_id,
                          self.cfg.trainer.micro_batch_size, self.batch_format.pad_id, self.packing)
                self.train_data = cached_reference(self.run_dir, "train", self.train_data, *common)
                if self.val_data is not None:
                    self.val_data = cached_reference(self.run_dir, "val", self.val_data, *common)
                self.reference = None  # the table replaces it
        super().resume()

    def sequence_micro_batches(self, groups: list[list], sequences_of) -> tuple[list[dict], int]:
        """Padded or packed micro-batches of each group's sequences; two sequences per sample (a pair,
        or KTO's completion and its mismatched twin) share their common prefix when packed."""
        per_sample = [[sequences_of(s) for s in g] for g in groups]
        pairs = len(per_sample[0][0]) == 2
        return build_micro_batches([interleave(seqs) for seqs in per_sample], self.batch_format.pad_id,
                                   multiple=self.length_multiple, pairs=pairs, **self.packing)

    def step_micro_batches(self, samples: list) -> tuple[list[dict], int]:
        mbs = self.cfg.trainer.micro_batch_size
        mine = split_for_rank(samples, self.dp_rank, self.dp_size)
        groups = [mine[i:i + mbs] for i in range(0, len(mine), mbs)]
        micro, length = self.sequence_micro_batches(groups, self.algorithm.sequences)
        self.algorithm.annotate(self, samples, groups, micro, length)
        return micro, length

    def reference_logprobs(self, groups: list[list], sequences_of, micro: list[dict] | None = None,
                           length: int = 0) -> list[torch.Tensor]:
        """Reference log-prob sums of each micro-batch's `sequences_of` its samples (in micro-batch
        order) on the last pipeline stage, an empty list elsewhere. Pass `micro`/`length` when those
        sequences are the training ones, to reuse the built micro-batches."""
        if self.reference is None:  # precomputed: carried by the samples
            k = len(sequences_of(groups[0][0]))
            return [torch.tensor([s.reference[j] for j in range(k) for s in g]) for g in groups]
        if micro is None:
            micro, length = self.sequence_micro_batches(groups, sequences_of)
        return self.reference.logprob_sums(micro, length)


def attach(micro: list[dict], key: str, values: list[torch.Tensor]) -> None:
    """Give micro-batch i `values[i]` under `key`."""
    for batch, value in zip(micro, values):
        batch[key] = value


def flat_packing(packed: bool, model) -> bool:
    """Whether packed rows are flat (no padding between bins): where the attention takes block masks.
    The portable context-parallel attention takes a dense mask over its chunks of a row instead."""
    return packed and ps.get_context_parallel_world_size() == 1 and all_fused(unwrap(model))


def packing_enabled(cfg) -> bool:
    """Whether a run packs its batches: `data.packing` true or false, or null (auto): packed on the
    local layer spec, padded on the Transformer-Engine spec (said in the log). Packed and padded
    batches give the same results; packing only saves work."""
    engine = gpt.use_transformer_engine(cfg.model.transformer_impl)
    if cfg.data.packing is None:
        if engine:
            log.info("data.packing=null (auto): padded batches, since the Transformer-Engine attention takes no "
                     "tree masks")
        return not engine
    if cfg.data.packing and engine:
        raise ValueError("data.packing=true needs the local layer spec (model.transformer_impl=local): the "
                         "Transformer-Engine attention ignores the block-causal mask and its THD packed format "
                         "is not wired in yet; data.packing=null packs only where it can")
    return bool(cfg.data.packing)
