"""The RL loss on megatron's forward step: micro-batches of rollout samples, the per-token values the
model gives (log-probs under the sampling distribution, entropy), and the policy loss with its KL,
entropy, importance-sampling and mismatch terms.

Layout. A micro-batch is a sequence batch (`aligner.data.packing.build_micro_batches`, padded or
packed rows) of samples' prompt + response, plus per-sample tensors indexed by *response token*:
`response_mask` (1 on the tokens trained: the engine's; 0 on a multi-turn episode's observation tokens and
on an invalid sample), `engine_logprobs` (and later `old_logprobs`, `ref_logprobs`) [n, T], `advantages`
[n], `response_start` [n] (the prompt length). `response_values` moves the model's per-position
values into that [n, T] layout (position p of sample i predicts its token p + 1, response token
p + 1 - response_start[i]), so the maths in `maths` sees one row per sample, however the
sequences were packed.

Denominators are global: the loss returns the sum of its terms over the micro-batch's samples with
`count` = response tokens (token_mean) or sequences (the seq_mean modes), and megatron divides the
gradients by the count summed over every micro-batch and data-parallel rank of the optimizer step
(`calculate_per_token_loss`), so the update does not depend on how the batch was split.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from aligner.algorithms.online import mismatch
from aligner.algorithms.online.maths import aggregate_loss, kl_penalty, policy_loss
from aligner.algorithms.shared.maths import masked_sum
from aligner.algorithms.online.samples import Sample
from aligner.data.packing import build_micro_batches
from aligner.generation.trainer_logprobs import filtered_local_logits
from aligner.generation.types import SamplingParams
from aligner.models.forward_step import counted_once
from aligner.models.logprobs import vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy
from aligner.runtime.distributed import sum_over_group


def rl_micro_batches(groups: list[list[Sample]], pad_id: int, packing: dict, multiple: int) -> tuple[list[dict], int]:
    """Micro-batches (one per group of samples) sharing one length; see the module doc."""
    micro, length = build_micro_batches([[s.sequence() for s in g] for g in groups], pad_id, multiple=multiple,
                                        **packing)
    for batch, group in zip(micro, groups):
        width = max(len(s.response_ids) for s in group)

        def rows(values_of, fill=0.0):
            return torch.tensor([values_of(s) + [fill] * (width - len(s.response_ids)) for s in group],
                                dtype=torch.float32)

        batch["response_start"] = torch.tensor([len(s.prompt.ids) for s in group])
        batch["response_mask"] = rows(lambda s: [float(s.valid and m) for m in s.response_token_mask()])
        batch["engine_logprobs"] = rows(lambda s: list(s.engine_logprobs))
        batch["advantages"] = torch.tensor([s.advantage for s in group], dtype=torch.float32)
    return micro, length


def set_advantages_and_validity(batch: dict, group: list[Sample]) -> None:
    """The group's advantages, and its response mask zeroed on samples found invalid since the batch was built
    (their scores failed), on the device the batch's tensors are on by then: the log-prob passes moved them to
    the GPU (forward_step.run_model), where a CPU factor would fail the product."""
    mask = batch["response_mask"]
    batch["advantages"] = torch.tensor([s.advantage for s in group], dtype=torch.float32, device=mask.device)
    batch["response_mask"] = mask * torch.tensor([[float(s.valid)] for s in group], dtype=mask.dtype,
                                                 device=mask.device)


def response_values(values: torch.Tensor, local: dict, batch: dict) -> torch.Tensor:
    """Per-position values [rows, length(, k)] of this CP rank's positions (`local`) of a sequence batch ->
    [n, T(, k)] per response token (0 past a response's end), whole: under context parallelism each
    position lives on one CP rank, so the rows are summed over the CP group (backward: each rank's
    gradient reaches its own positions, `forward_step`'s module doc). Differentiable."""
    n, width = batch["response_mask"].shape
    read = local["loss_mask"] > 0
    sample = local["sequence_index"][read]
    column = local["position_ids"][read] + 1 - batch["response_start"][sample]
    rows = values.new_zeros(n, width, *values.shape[2:], dtype=torch.float32)
    rows = rows.index_put((sample, column), values[read].float())
    if ps.get_context_parallel_world_size() > 1:
        rows = sum_over_group(rows, ps.get_context_parallel_group())
    return rows


def token_values(vocab_size: int, params: SamplingParams, entropy_grad: bool):
    """PositionValues of the policy: [..., 2] = (log q(label), entropy of q), q the engine's sampling
    distribution recomputed from this rank's vocab-parallel logits (`trainer_logprobs`); the entropy
    carries a gradient only for an entropy bonus."""
    def values(logits, local):
        q_logits = filtered_local_logits(logits, params, vocab_size)
        logprobs, entropy = vocab_parallel_logprobs_and_entropy(q_logits, local["labels"], vocab_size, entropy_grad)
        return torch.stack([logprobs, entropy.to(logprobs.dtype)], -1)

    return values


def token_logprob_values(vocab_size: int, params: SamplingParams):
    """PositionValues of a forward-only log-prob pass: [..., 1] = log q(label), as `token_values`
    without the entropy, which only the update reports (over the vocabulary it costs as much as the
    log-probs)."""
    def values(logits, local):
        q_logits = filtered_local_logits(logits, params, vocab_size)
        return vocab_parallel_logprobs(q_logits, local["labels"], vocab_size).unsqueeze(-1)

    return values


def logprobs_output(values: torch.Tensor, local: dict, batch: dict) -> torch.Tensor:
    """A forward-only pass's output: per-response-token log-probs [n, T] (`forward_step.collect`)."""
    return response_values(values[..., 0], local, batch)


class PolicyLoss:
    """The reduction of the RL training step (`forward_step.make_forward_step`): PPO's clipped
    surrogate on group advantages, plus kl.coef x KL(policy || reference) under kl.mode=loss, minus
    entropy_coef x entropy, all aggregated alike. Reports sums (per response token unless named)."""

    def __init__(self, algorithm, max_new_tokens: int):
        self.a, self.max_new_tokens = algorithm, max_new_tokens

    def _aggregate(self, values, mask):
        return aggregate_loss(values, mask, str(self.a.aggregation), self.max_new_tokens, 1.0, 1.0)

    def __call__(self, values: torch.Tensor, local: dict, batch: dict):
        a, mask = self.a, batch["response_mask"]
        logprobs, entropy = response_values(values, local, batch).unbind(-1)
        old = batch["old_logprobs"] if "old_logprobs" in batch else logprobs.detach()
        engine = batch["engine_logprobs"]
        # the trainer's log-probs of the rollout policy against the engine's: with old_logprobs=engine the
        # old ones are the engine's, and the update's own forward is the rollout policy's on its first pass
        trainer = logprobs.detach() if a.old_logprobs == "engine" else old
        weights = None
        if a.importance_sampling.level != "none":
            weights = mismatch.truncated_is_weights(old, engine, mask, str(a.importance_sampling.level),
                                                    a.importance_sampling.cap)
        loss, stats = policy_loss(logprobs, old, batch["advantages"], mask, a.clip_low, a.clip_high, a.dual_clip,
                                  str(a.aggregation), str(a.ratio_level), weights, self.max_new_tokens, 1.0, 1.0)
        tokens = mask.sum()
        report = {"tokens": tokens, "entropy": masked_sum(entropy.detach(), mask),
                  "clip_fraction": stats["clip_fraction"] * tokens, "approx_kl": stats["approx_kl"] * tokens,
                  "token_prob_error": mismatch.token_prob_error(trainer, engine, mask) * tokens,
                  "mismatch_kl": mismatch.kl(trainer, engine, mask) * tokens}
        if weights is not None:
            report["is_truncated"] = mismatch.truncated_fraction(old, engine, mask, str(a.importance_sampling.level),
                                                                 a.importance_sampling.cap) * tokens
        if "ref_logprobs" in batch:
            kl = kl_penalty(logprobs, batch["ref_logprobs"], str(a.kl.estimator))
            report["kl"] = masked_sum(kl.detach(), mask)
            if a.kl.mode == "loss" and a.kl.coef:
                loss = loss + a.kl.coef * self._aggregate(kl, mask)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * self._aggregate(entropy, mask)
        count = tokens if a.aggregation == "token_mean" else (mask.sum(-1) > 0).sum().float()
        report["loss"] = loss.detach()
        return counted_once(loss, count, report)  # every CP rank computed it on the whole responses
