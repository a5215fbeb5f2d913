"""The losses of the preference algorithms on per-sequence log-probs (the maths is in `maths`):
DPO and its variants, ORPO, SimPO, KTO. Each binds which
sequences a sample trains on, the pre-passes its loss needs (`annotate`) and `loss(sums, counts,
batch) -> (loss sum, count, report sums)`; `shared/sequence_trainer.py` runs them."""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from aligner.algorithms.preference import maths
from aligner.algorithms.shared.sequence_trainer import SequenceObjective, attach
from aligner.algorithms.shared.sequence_logprobs import logprob_sums
from aligner.data.packing import with_response_mask
from aligner.runtime import collectives


# ---- DPO, ORPO, SimPO ----------------------------------------------------------------------------------
def _pair_sequences(sample) -> list:
    return [with_response_mask(sample.chosen, sample.chosen_start),
            with_response_mask(sample.rejected, sample.rejected_start)]


def _halves(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = values.shape[0] // 2
    return values[:pairs], values[pairs:]


class DPO(SequenceObjective):
    """DPO and its variants (`preference/maths.dpo_loss`), with an optional SFT term on the chosen
    response: loss = dpo_loss + sft_weight * (-log pi(y_c|x)), the log-probs summed or averaged
    over the response tokens (`average_logprobs`) in both terms, as in NeMo-Aligner. Count: pairs.
    Metrics (means over pairs): loss, loss/preference and loss/sft (with an SFT term), accuracy
    (chosen reward above rejected, ties 1/2), reward/chosen and reward/rejected (beta (pi - ref)),
    reward/margin, logps/chosen and logps/rejected (the policy's, as reduced)."""

    uses_reference = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.loss_type = cfg.loss_type
        self.rewards = self.loss_type.startswith("rpo")

    def sequences(self, sample) -> list:
        return _pair_sequences(sample)

    def annotate(self, trainer, samples, groups, micro, length) -> None:
        attach(micro, "reference", trainer.reference_logprobs(groups, self.sequences, micro, length))
        if self.rewards:
            attach(micro, "chosen_rewards", [torch.tensor([s.chosen_reward for s in g]) for g in groups])
            attach(micro, "rejected_rewards", [torch.tensor([s.rejected_reward for s in g]) for g in groups])

    def loss(self, sums, counts, batch):
        c = self.cfg
        reduce = (lambda x: x / counts.clamp(min=1)) if c.average_logprobs else (lambda x: x)
        policy_c, policy_r = _halves(reduce(sums))
        ref_c, ref_r = _halves(reduce(batch["reference"].to(sums)))
        losses = maths.dpo_loss(policy_c, policy_r, ref_c, ref_r, c.beta, self.loss_type, c.label_smoothing,
                            batch.get("chosen_rewards"), batch.get("rejected_rewards"), c.reward_scale)
        reward_c, reward_r = c.beta * (policy_c - ref_c).detach(), c.beta * (policy_r - ref_r).detach()
        report = {"accuracy": maths.preference_accuracy(reward_c, reward_r).sum(), "reward/chosen": reward_c.sum(),
                  "reward/rejected": reward_r.sum(), "reward/margin": (reward_c - reward_r).sum(),
                  "logps/chosen": policy_c.detach().sum(), "logps/rejected": policy_r.detach().sum()}
        if c.sft_weight:
            report["loss/preference"] = losses.detach().sum()
            report["loss/sft"] = -policy_c.detach().sum()
            losses = losses - c.sft_weight * policy_c
        loss = losses.sum()
        report["loss"] = loss.detach()
        return loss, torch.tensor(policy_c.shape[0], device=sums.device), report


class ORPO(SequenceObjective):
    """ORPO (`maths.orpo_loss`) on length-averaged log-probs; reference-free. Metrics: loss,
    loss/nll, loss/odds_ratio, accuracy (chosen mean log-prob above rejected), log_odds_ratio,
    logps/chosen, logps/rejected (mean per token)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def sequences(self, sample) -> list:
        return _pair_sequences(sample)

    def loss(self, sums, counts, batch):
        chosen, rejected = _halves(sums / counts.clamp(min=1))
        losses = maths.orpo_loss(chosen, rejected, self.cfg.odds_ratio_weight)
        odds = (maths.log_odds(chosen) - maths.log_odds(rejected)).detach()
        loss = losses.sum()
        report = {"loss": loss.detach(), "loss/nll": -chosen.detach().sum(),
                  "loss/odds_ratio": -torch.nn.functional.logsigmoid(odds).sum(),
                  "accuracy": maths.preference_accuracy(chosen.detach(), rejected.detach()).sum(),
                  "log_odds_ratio": odds.sum(), "logps/chosen": chosen.detach().sum(),
                  "logps/rejected": rejected.detach().sum()}
        return loss, torch.tensor(chosen.shape[0], device=sums.device), report


class SimPO(SequenceObjective):
    """SimPO (`maths.simpo_loss`) on length-averaged log-probs; reference-free. Metrics: loss,
    accuracy, reward/chosen and reward/rejected (beta x mean log-prob), reward/margin, logps/*."""

    def __init__(self, cfg):
        self.cfg = cfg

    def sequences(self, sample) -> list:
        return _pair_sequences(sample)

    def loss(self, sums, counts, batch):
        c = self.cfg
        chosen, rejected = _halves(sums / counts.clamp(min=1))
        loss = maths.simpo_loss(chosen, rejected, c.beta, c.gamma, c.label_smoothing).sum()
        reward_c, reward_r = c.beta * chosen.detach(), c.beta * rejected.detach()
        report = {"loss": loss.detach(), "accuracy": maths.preference_accuracy(reward_c, reward_r).sum(),
                  "reward/chosen": reward_c.sum(), "reward/rejected": reward_r.sum(),
                  "reward/margin": (reward_c - reward_r).sum(), "logps/chosen": chosen.detach().sum(),
                  "logps/rejected": rejected.detach().sum()}
        return loss, torch.tensor(chosen.shape[0], device=sums.device), report


# ---- KTO ------------------------------------------------------------------------------------------------
class KTO(SequenceObjective):
    """KTO (`maths.kto_loss`) on unpaired samples with summed log-probs. Each step first
    estimates the reference point z0 over the whole global batch (so it does not depend on the
    micro-batch or DP split): the policy's and the reference's log-probs of every sample's mismatched
    sequence (`aligner.data.preference`), no grad. Count: samples. Metrics: loss, kl (z0),
    reward/desirable and reward/undesirable (mean beta (pi - ref) over each class of the global
    batch), reward/margin (their difference), logps/desirable, logps/undesirable, and
    fraction/desirable."""

    uses_reference = True

    def __init__(self, cfg):
        self.cfg = cfg

    def sequences(self, sample) -> list:
        return [with_response_mask(sample.ids, sample.start)]

    def reference_sequences(self, sample) -> list:
        return [with_response_mask(sample.ids, sample.start), with_response_mask(sample.kl_ids, sample.kl_start)]

    def annotate(self, trainer, samples, groups, micro, length) -> None:
        reference = trainer.reference_logprobs(groups, self.reference_sequences)
        kl_micro, kl_length = trainer.sequence_micro_batches(groups, lambda s: self.reference_sequences(s)[1:])
        policy_kl = logprob_sums(trainer.model, kl_micro, kl_length, trainer.vocab_size)
        desirable = sum(s.desirable for s in samples)
        for g, batch, ref, pol in zip(groups, micro, reference, policy_kl):
            batch["reference"], batch["kl_gap"] = ref[:len(g)], (pol - ref[len(g):].to(pol)).sum()
            batch["desirable"] = torch.tensor([s.desirable for s in g])
            # weights turning per-sample sums into class means over the global batch
            batch["class_weight"] = torch.tensor([len(samples) / desirable if s.desirable
                                                  else len(samples) / (len(samples) - desirable) for s in g])
            batch["fraction_desirable"] = torch.tensor(desirable / len(samples))
        if ps.is_pipeline_last_stage():
            gap = sum(b["kl_gap"] for b in micro)
            collectives.all_reduce(gap, group=ps.get_data_parallel_group())  # the same on every CP/TP rank already
            kl = maths.kto_kl_estimate(gap, len(samples))
            attach(micro, "kl", [kl] * len(micro))

    def loss(self, sums, counts, batch):
        c = self.cfg
        ref = batch["reference"].to(sums)
        desirable = batch["desirable"]
        losses = maths.kto_loss(sums, ref, desirable, batch["kl"], c.beta, c.desirable_weight, c.undesirable_weight)
        loss = losses.sum()
        reward = c.beta * (sums - ref).detach()
        weight = batch["class_weight"].to(sums)
        d, u = desirable.float(), (~desirable).float()
        report = {"loss": loss.detach(), "kl": batch["kl"] * len(sums),
                  "reward/desirable": (reward * weight * d).sum(), "reward/undesirable": (reward * weight * u).sum(),
                  "reward/margin": (reward * weight * (d - u)).sum(),
                  "logps/desirable": (sums.detach() * weight * d).sum(),
                  "logps/undesirable": (sums.detach() * weight * u).sum(),
                  "fraction/desirable": batch["fraction_desirable"] * len(sums)}
        return loss, torch.tensor(len(sums), device=sums.device), report
