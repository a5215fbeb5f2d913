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
(tests/test_packing.py, tests/test_rm.py).

Loss conventions (the maths is in `functional`; the trainer divides sums by the global count):
* `bt`:         -log sigmoid(r_chosen - r_rejected), summed over pairs; count = pairs.
* `margin_bt`:  -log sigmoid(r_chosen - r_rejected - margin), margin from each record (default 0).
* `regression`: squared error over labelled (sample, attribute) entries; count = labelled entries.
Pair metrics: `accuracy` = fraction of pairs with r_chosen > r_rejected (a tie counts 1/2, so a
constant model scores chance), `reward/margin` = mean r_chosen - r_rejected, `reward/chosen`,
`reward/rejected` = mean rewards. Regression metrics: `loss` (MSE), `abs_error` (MAE).
"""
from __future__ import annotations

from pathlib import Path

import torch

from aligner.algorithms import functional as F
from aligner.algorithms.preference import PreferenceAlgorithm, PreferenceTrainer
from aligner.algorithms.trainer import Trainer
from aligner.runtime.distributed import sum_over_group


# ---- losses and reports ---------------------------------------------------------------------------
def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor | None = None):
    """chosen, rejected, margins: [pairs] -> (BT loss sum, report sums)."""
    loss = F.bradley_terry_loss(chosen, rejected, margins).sum()
    delta = (chosen - rejected).detach()
    report = {"loss": loss.detach(), "accuracy": F.preference_accuracy(chosen.detach(), rejected.detach()).sum(),
              "reward/margin": delta.sum(), "reward/chosen": chosen.detach().sum(),
              "reward/rejected": rejected.detach().sum()}
    return loss, report


def regression_loss(predicted: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    """predicted, labels, mask: [b, attributes] -> (squared-error sum, count, report sums)."""
    squared = F.masked_squared_error(predicted, labels, mask)
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
    """`RegressionSample`s -> tokens [b, L], lengths [b], labels and label_mask [b, attributes]."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def length(self, sample) -> int:
        return len(sample.ids)

    tokens = length

    def collate(self, samples, length: int) -> dict:
        tokens, lengths = _pad_rows([s.ids for s in samples], length, self.pad_id)
        return {"tokens": tokens, "lengths": lengths,
                "labels": torch.tensor([s.labels for s in samples], dtype=torch.float32),
                "label_mask": torch.tensor([s.label_mask for s in samples], dtype=torch.float32)}


# ---- packed batches (data.packing=true) ---------------------------------------------------------------
def scored_sequence(ids, pad_id: int):
    """`ids` as a sequence of the packing machinery (`aligner.data.packing`) whose one masked position
    is its last token, where the reward is read: the model reads all of `ids`, the appended pad is
    the (unused) label of the last position. Both sides of a pair tree end in their own branch."""
    return list(ids) + [pad_id], [0] * len(ids) + [1]


class PackedRewardObjective(PreferenceAlgorithm):
    """Reward-model losses through the sequence machinery of the preference trainers, so packed
    rows compute a pair's common prefix once (`aligner.data.packing`): per-sequence sums of the head
    outputs over the one masked position are the rewards. `kind`: "pairs", "margin_pairs" or
    "regression" (single sequences packed as they are)."""

    def __init__(self, kind: str, pad_id: int):
        self.kind, self.pad_id = kind, pad_id

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
        if self.kind == "regression":
            return regression_loss(scores, batch["attribute_labels"].to(scores), batch["attribute_mask"].to(scores))
        pairs = scores.shape[0] // 2
        margins = batch["margins"].to(scores) if self.kind == "margin_pairs" else None
        loss, report = pair_loss(scores[:pairs, 0], scores[pairs:, 0], margins)
        return loss, torch.tensor(float(pairs), device=scores.device), report


# ---- forward step ---------------------------------------------------------------------------------
def sequence_scores(values: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Head outputs at each sequence's last token. values [b, s_local, k] at global `positions`
    [s_local] (this CP rank's chunks) -> [b, k], summed over the context-parallel group."""
    from megatron.core import parallel_state as ps

    from aligner.models.heads import last_token_scores

    if ps.get_context_parallel_world_size() == 1:
        return last_token_scores(values, lengths)
    at_last = (positions.view(1, -1) == (lengths.view(-1, 1) - 1)).to(values.dtype)
    local = (values * at_last.unsqueeze(-1)).sum(1)
    return sum_over_group(local, ps.get_context_parallel_group())


def make_rm_forward_step(kind: str):
    """The megatron forward step for `kind` "pairs" (BT, with the batch's margins) or "regression"."""
    from megatron.core import parallel_state as ps

    from aligner.models.cp_attention import positions_on_rank

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    use_margins = kind == "margin_pairs"

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if device is not None:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        tokens = batch["tokens"]
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        positions = (positions_on_rank(tokens.shape[1], cp, cp_rank) if cp > 1
                     else torch.arange(tokens.shape[1])).to(tokens.device)
        output = model(tokens[:, positions], positions.unsqueeze(0).expand(tokens.shape[0], -1), None)

        def loss_func(values):
            scores = sequence_scores(values.float(), batch["lengths"], positions)
            if kind == "regression":
                loss, count, report = regression_loss(scores, batch["labels"], batch["label_mask"])
            else:
                pairs = scores.shape[0] // 2
                chosen, rejected = scores[:pairs, 0], scores[pairs:, 0]
                loss, report = pair_loss(chosen, rejected, batch["margins"] if use_margins else None)
                count = torch.tensor(float(pairs), device=scores.device)
            # Every CP rank computes the same loss; the count and the reports come from CP rank 0 once.
            keep = 1.0 if cp_rank == 0 else 0.0
            report = {k: v.detach().float() * keep for k, v in report.items()}
            report["count"] = count.detach().float() * keep
            return loss, (count * keep).int(), report

        return output, loss_func

    return forward_step


# ---- checkpoints ----------------------------------------------------------------------------------
def head_outputs(path) -> int | None:
    """Outputs of a checkpoint's scalar head (None for a language-model checkpoint)."""
    from aligner.models.checkpoint import read_metadata

    meta = read_metadata(path)
    if meta.get("head", "lm") == "lm":
        return None
    if "scalar_head" in meta:
        return int(meta["scalar_head"]["num_outputs"])
    from megatron.core import dist_checkpointing

    return int(dist_checkpointing.load_tensors_metadata(str(Path(path) / "weights"))["output_layer.weight"].shape[0])


def load_pretrained(path, model, num_outputs: int) -> bool:
    """Load a checkpoint into a scalar-head model (any TP/PP): all weights when its head has
    `num_outputs` outputs, else everything but the head (a language model, or a reward model with
    other attributes), which keeps its initialisation. Collective. Returns whether the head loaded."""
    from megatron.core import dist_checkpointing

    from aligner.models.checkpoint import unwrap

    inner = unwrap(model)
    sharded = inner.sharded_state_dict()
    with_head = head_outputs(path) == num_outputs
    skipped = [] if with_head else [k for k in sharded if k.startswith("output_layer.")]
    for key in skipped:
        del sharded[key]
    loaded = dist_checkpointing.load({"model": sharded}, str(Path(path) / "weights"))["model"]
    missing, unexpected = inner.load_state_dict(loaded, strict=False)
    if set(missing) - set(skipped) or unexpected:
        raise RuntimeError(f"{path} does not fit this model: missing {sorted(set(missing) - set(skipped))[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
    return with_head


class RewardModelTrainer(Trainer):
    """The shared loop, saving the head's description with each checkpoint and starting from a
    language-model (or reward) checkpoint's weights."""

    def __init__(self, *args, head_meta: dict, **kwargs):
        super().__init__(*args, head="reward", extra_meta={"scalar_head": head_meta}, **kwargs)
        self.head_meta = head_meta

    def resume(self) -> None:
        from aligner.models import checkpoint

        if checkpoint.latest_checkpoint(self.run_dir / "checkpoints") is None and self.cfg.model.pretrained:
            load_pretrained(self.cfg.model.pretrained, self.model, self.head_meta["num_outputs"])
            return
        super().resume()


class PackedRewardModelTrainer(RewardModelTrainer, PreferenceTrainer):
    """`RewardModelTrainer` whose micro-batches are built by `PreferenceTrainer` (the packed
    sequences of a `PackedRewardObjective`)."""


# ---- entry points ---------------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    from aligner.config import load_resolved

    run(load_resolved(argv[0], "rm"))


def run(cfg) -> None:
    """One rank of `aligner train rm` with a validated config."""
    from aligner.algorithms.preference import (PreferenceFormat, build_policy, head_outputs,
                                               make_sequence_forward_step, packing_enabled)
    from aligner.data.preference_rm import load_rm_dataset
    from aligner.data.tokenizer import load_tokenizer, model_vocab_size
    from aligner.models.gpt import build_gpt
    from aligner.models.heads import attach_scalar_head
    from aligner.models.training import wrap_for_training
    from aligner.runtime import distributed

    m, rm, d = cfg.model, cfg.rm, cfg.data
    loss = rm.loss.value if hasattr(rm.loss, "value") else str(rm.loss)
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
        objective = PackedRewardObjective(step_kind, tokenizer.pad_token_id)
        model = attach_scalar_head(build_policy(m, vocab_size), num_outputs)
        model, optimizer, scheduler = wrap_for_training(model, m, cfg.optim)
        step = make_sequence_forward_step(objective.loss, vocab_size, head_outputs)
        trainer = PackedRewardModelTrainer(cfg, model, optimizer, scheduler, step, train, val,
                                           PreferenceFormat(objective, tokenizer.pad_token_id), vocab_size,
                                           tokenizer, head_meta=head_meta, algorithm=objective, reference_mode=None,
                                           packing={"packed": True, "capacity": d.pack_length})
    else:
        model = attach_scalar_head(build_gpt(m, vocab_size), num_outputs)
        model, optimizer, scheduler = wrap_for_training(model, m, cfg.optim)
        batch_format = (RegressionFormat if kind == "regression" else PairFormat)(tokenizer.pad_token_id)
        trainer = RewardModelTrainer(cfg, model, optimizer, scheduler, make_rm_forward_step(step_kind), train, val,
                                     batch_format, vocab_size, tokenizer, head_meta=head_meta)
    trainer.fit()
    distributed.shutdown()
