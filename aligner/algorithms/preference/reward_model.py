"""Reward-model training (`aligner train rm`): Bradley-Terry on preference pairs, margin-BT, and
multi-attribute regression (HelpSteer / SteerLM style) with unlabelled attributes masked out.

The model is the GPT with a scalar head (`aligner.models.heads`); a sequence's reward is the head
output at its last real token. A pair micro-batch holds the chosen sequences in its first half of
rows and the rejected ones in the second, so one forward pass scores both. Under context
parallelism each rank holds two chunks of every sequence: the rank holding a sequence's last token
contributes its score and the scores are summed over the CP group.
Packed (`data.packing`; by default on the local layer spec), the batches are those of the preference
trainers instead (`aligner.data.packing`): a pair's common prefix (the prompt) is computed once as the
trunk of a pair tree, each side's reward is read at its last token in its own branch, and regression
samples are packed as plain sequences; the losses, metrics and gradients are the padded ones
(tests/unit/test_packing.py, tests/e2e/test_rm.py).

Loss conventions (the maths is in `maths`; the trainer divides sums by the global count):
* `bt`:         -log sigmoid(r_chosen - r_rejected), summed over pairs; count = pairs.
* `margin_bt`:  -log sigmoid(r_chosen - r_rejected - margin), margin from each record (default 0).
* `rm.center_coef` c > 0 adds c * (r_chosen + r_rejected)^2 per pair (Eisenstein et al. 2023; TRL's
  `center_rewards_coefficient`). BT fixes rewards only up to a per-prompt offset; this pins each
  prompt's offset near 0, so rewards are comparable across prompts and a PPO critic need not learn it.
* `regression`: squared error over labelled (sample, attribute) entries; count = labelled entries.
Pair metrics: `accuracy` = fraction of pairs with r_chosen > r_rejected (a tie counts 1/2, so a
constant model scores chance), `reward/margin` = mean r_chosen - r_rejected, `reward/chosen`,
`reward/rejected` = mean rewards. Regression metrics: `loss` (MSE), `abs_error` (MAE).
"""
from __future__ import annotations

import torch

from aligner.algorithms.preference import maths
from aligner.algorithms.shared.sequence_trainer import (SequenceObjective, SequenceFormat, SequenceTrainer,
                                                   packing_enabled)
from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step
from aligner.algorithms.shared.trainer import Trainer
from aligner.config import load_resolved
from aligner.data.preference_rm import load_rm_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.models import checkpoint
from aligner.models.forward_step import head_values, last_token_reduction, make_forward_step
from aligner.models.gpt import build_gpt
from aligner.models.heads import attach_scalar_head
from aligner.models.policy import build_policy
from aligner.models.training import wrap_for_training
from aligner.runtime import distributed


# ---- losses and reports ---------------------------------------------------------------------------
def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor | None = None,
              center_coef: float = 0.0):
    """chosen, rejected, margins: [pairs] -> (BT loss sum (+ the centering term), report sums)."""
    loss = maths.bradley_terry_loss(chosen, rejected, margins).sum()
    if center_coef:
        loss = loss + center_coef * maths.reward_centering_penalty(chosen, rejected).sum()
    delta = (chosen - rejected).detach()
    report = {"loss": loss.detach(), "accuracy": maths.preference_accuracy(chosen.detach(), rejected.detach()).sum(),
              "reward/margin": delta.sum(), "reward/chosen": chosen.detach().sum(),
              "reward/rejected": rejected.detach().sum()}
    return loss, report


def regression_loss(predicted: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    """predicted, labels, mask: [b, attributes] -> (squared-error sum, count, report sums)."""
    squared = maths.masked_squared_error(predicted, labels, mask)
    loss = squared.sum()
    return loss, mask.sum(), {"loss": loss.detach(), "abs_error": squared.detach().sqrt().sum()}


# ---- batches ------------------------------------------------------------------------------------
def _pad_rows(rows: list[list[int]], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    for i, ids in enumerate(rows):
        if len(ids) > length:
            raise ValueError(f"row {i} has {len(ids)} tokens, more than length={length}")
        tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return tokens, torch.tensor([len(ids) for ids in rows], dtype=torch.int64)


class PairFormat:
    """`PairSample`s -> tokens [2b, L] (chosen rows, then rejected rows), lengths [2b], margins [b]."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def length(self, sample) -> int:
        return max(len(sample.chosen), len(sample.rejected))

    def tokens(self, sample) -> int:
        return len(sample.chosen) + len(sample.rejected)

    def collate(self, samples, length: int) -> dict:
        tokens, lengths = _pad_rows([s.chosen for s in samples] + [s.rejected for s in samples], length, self.pad_id)
        return {"tokens": tokens, "lengths": lengths,
                "margins": torch.tensor([s.margin for s in samples], dtype=torch.float32)}


class RegressionFormat:
    """`RegressionSample`s -> tokens [b, L], lengths [b], attribute_labels and attribute_mask [b, attributes]."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def length(self, sample) -> int:
        return len(sample.ids)

    tokens = length

    def collate(self, samples, length: int) -> dict:
        tokens, lengths = _pad_rows([s.ids for s in samples], length, self.pad_id)
        return {"tokens": tokens, "lengths": lengths,
                "attribute_labels": torch.tensor([s.labels for s in samples], dtype=torch.float32),
                "attribute_mask": torch.tensor([s.label_mask for s in samples], dtype=torch.float32)}


# ---- packed batches (data.packing=true) ---------------------------------------------------------------
def scored_sequence(ids, pad_id: int):
    """`ids` as a sequence of the packing machinery (`aligner.data.packing`) whose one masked position
    is its last token, where the reward is read: the model reads all of `ids`, the appended pad is
    the (unused) label of the last position. Both sides of a pair tree end in their own branch."""
    return list(ids) + [pad_id], [0] * len(ids) + [1]


class PackedRewardObjective(SequenceObjective):
    """Reward-model losses through the sequence machinery of the preference trainers, so packed
    rows compute a pair's common prefix once (`aligner.data.packing`): per-sequence sums of the head
    outputs over the one masked position are the rewards. `kind`: "pairs", "margin_pairs" or
    "regression" (single sequences packed as they are)."""

    def __init__(self, kind: str, pad_id: int, center_coef: float = 0.0):
        self.kind, self.pad_id = kind, pad_id
        self._score_loss = score_loss(kind, center_coef)  # built once, called on every micro-batch

    def sequences(self, sample) -> list:
        if self.kind == "regression":
            return [scored_sequence(sample.ids, self.pad_id)]
        return [scored_sequence(sample.chosen, self.pad_id), scored_sequence(sample.rejected, self.pad_id)]

    def tokens(self, sample) -> int:
        return len(sample.ids) if self.kind == "regression" else len(sample.chosen) + len(sample.rejected)

    def annotate(self, trainer, samples, groups, micro, length) -> None:
        for batch, group in zip(micro, groups):
            if self.kind == "regression":
                batch["attribute_labels"] = torch.tensor([s.labels for s in group], dtype=torch.float32)
                batch["attribute_mask"] = torch.tensor([s.label_mask for s in group], dtype=torch.float32)
            else:
                batch["margins"] = torch.tensor([s.margin for s in group], dtype=torch.float32)

    def loss(self, scores, counts, batch):
        return self._score_loss(scores, batch)


# ---- forward step ---------------------------------------------------------------------------------
def score_loss(kind: str, center_coef: float = 0.0):
    """(scores [n, k], batch) -> (loss, count, report) for `kind` "pairs" or "margin_pairs" (the first
    half of the scores are the chosen sequences', the second half the rejected ones') or "regression";
    `center_coef`: the pairs' centering term."""

    def loss(scores, batch):
        if kind == "regression":
            return regression_loss(scores, batch["attribute_labels"].to(scores), batch["attribute_mask"].to(scores))
        pairs = scores.shape[0] // 2
        margins = batch["margins"].to(scores) if kind == "margin_pairs" else None
        loss, report = pair_loss(scores[:pairs, 0], scores[pairs:, 0], margins, center_coef)
        return loss, torch.tensor(float(pairs), device=scores.device), report

    return loss


def make_rm_forward_step(kind: str, center_coef: float = 0.0):
    """The forward step of padded reward-model batches (`PairFormat`, `RegressionFormat`): the rewards
    are the head outputs at each row's last token."""
    return make_forward_step(head_values, last_token_reduction(score_loss(kind, center_coef)))


class RewardModelTrainer(Trainer):
    """The shared loop, saving the head's description with each checkpoint and starting from a
    language-model (or reward) checkpoint's weights."""

    def __init__(self, *args, head_meta: dict, **kwargs):
        super().__init__(*args, head="reward", extra_meta={"scalar_head": head_meta}, **kwargs)
        self.head_meta = head_meta

    def resume(self) -> None:
        if checkpoint.latest_checkpoint(self.run_dir / "checkpoints") is None and self.cfg.model.pretrained:
            checkpoint.load_into_scalar_model(self.cfg.model.pretrained, self.model, self.head_meta["num_outputs"])
            self.optimizer.reload_model_params()  # bf16: its fp32 main params still hold the initial weights
            return
        super().resume()


class PackedRewardModelTrainer(RewardModelTrainer, SequenceTrainer):
    """`RewardModelTrainer` whose micro-batches are built by `SequenceTrainer` (the packed
    sequences of a `PackedRewardObjective`)."""


# ---- entry points ---------------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "rm"))


def run(cfg) -> None:
    """One rank of `aligner train rm` with a validated config."""
    m, rm, d = cfg.model, cfg.rm, cfg.data
    loss = rm.loss
    attributes = list(rm.attributes)
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)
    kind = "regression" if loss == "regression" else "pairs"

    def load(path):
        return load_rm_dataset(path, tokenizer, kind, attributes, d.format, d.max_length, d.overlong)

    train, val = load(d.train_path), (load(d.val_path) if d.val_path else None)
    num_outputs = len(attributes) if kind == "regression" else 1
    head_meta = {"num_outputs": num_outputs, "attributes": attributes or None, "loss": loss}
    step_kind = "margin_pairs" if loss == "margin_bt" else kind
    if packed:  # several sequences per row, a pair's prompt computed once: the preference machinery
        objective = PackedRewardObjective(step_kind, tokenizer.pad_token_id, rm.center_coef)
        model = attach_scalar_head(build_policy(m, vocab_size), num_outputs)
        model, optimizer, scheduler = wrap_for_training(model, m, cfg.optim)
        step = sequence_loss_step(objective.loss, vocab_size, head_values)
        trainer = PackedRewardModelTrainer(cfg, model, optimizer, scheduler, step, train, val,
                                           SequenceFormat(objective, tokenizer.pad_token_id), vocab_size,
                                           tokenizer, head_meta=head_meta, algorithm=objective, reference_mode=None,
                                           packing={"packed": True, "capacity": d.pack_length})
    else:
        model = attach_scalar_head(build_gpt(m, vocab_size), num_outputs)
        model, optimizer, scheduler = wrap_for_training(model, m, cfg.optim)
        batch_format = (RegressionFormat if kind == "regression" else PairFormat)(tokenizer.pad_token_id)
        trainer = RewardModelTrainer(cfg, model, optimizer, scheduler, make_rm_forward_step(step_kind, rm.center_coef),
                                     train, val, batch_format, vocab_size, tokenizer, head_meta=head_meta)
    trainer.fit()
    distributed.shutdown()
