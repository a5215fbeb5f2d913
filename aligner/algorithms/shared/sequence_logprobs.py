"""The sequence log-prob step shared by the preference trainers, the reference model and RL:
per-sequence sums of a language model's label log-probs over each sequence's masked (response)
tokens, on sequence batches (`aligner.data.packing`), as a training forward step or forward only."""
from __future__ import annotations

import torch

from aligner.models.forward_step import (PositionValues, collect, label_logprobs, make_forward_step,
                                         run_micro_batches, sequence_reduction, sequence_sums)


def sequence_loss_step(sequence_loss, vocab_size: int, position_values: PositionValues | None = None):
    """The forward step of a training (or validation) pass: `sequence_loss(sums, counts, batch)` gets
    the per-sequence sums of `position_values` (default: the label log-probs of a language model) of
    the micro-batch's sequences, in the order they were given."""
    return make_forward_step(position_values or label_logprobs(vocab_size), sequence_reduction(sequence_loss))


@torch.no_grad()
def logprob_sums(model, micro_batches: list[dict], length: int, vocab_size: int) -> list[torch.Tensor]:
    """Per-sequence log-prob sums of every micro-batch (forward only, no grad, eval mode) on the last
    pipeline stage, summed over the CP group; an empty list on other stages."""
    step = make_forward_step(label_logprobs(vocab_size),
                             collect(lambda values, local, batch: sequence_sums(values, local, batch)[0]))
    return collected(model, step, micro_batches, length)


@torch.no_grad()
def collected(model, collect_step, micro_batches: list[dict], length: int) -> list:
    """What a `forward_step.collect` step keeps of each micro-batch (forward only, eval mode), on the last
    pipeline stage; an empty list on other stages."""
    was_training = model.training
    model.eval()
    try:
        outputs = run_micro_batches(model, collect_step, micro_batches, length, forward_only=True)
    finally:
        model.train(was_training)
    return [o["out"] for o in outputs]


def interleave(per_sample: list[list]) -> list:
    """[[a0, b0], [a1, b1]] -> [a0, a1, b0, b1]: sequence j of every sample, then sequence j + 1 (the
    order of a micro-batch's sequences: DPO's chosen ones, then the rejected ones)."""
    return [seqs[j] for j in range(len(per_sample[0])) for seqs in per_sample]
