"""Supervised fine-tuning: next-token NLL on the loss-masked (assistant / output) tokens.

Padded batches (one sample per row) run the plain GPT; packed ones (`data.packing`, several samples
per row) run the sequence machinery of the preference trainers with `SFTObjective`."""
from __future__ import annotations

import torch

from aligner.algorithms.shared.maths import token_nll_sum
from aligner.algorithms.shared.sequence_trainer import (SequenceFormat, SequenceObjective, SequenceTrainer,
                                                        packing_enabled)
from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step
from aligner.algorithms.shared.trainer import Trainer
from aligner.config import load_resolved
from aligner.data.loader import collate
from aligner.data.sft import load_sft_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.models.forward_step import label_logprobs, make_forward_step, token_reduction
from aligner.models.gpt import build_gpt
from aligner.models.policy import build_policy
from aligner.models.training import wrap_for_training
from aligner.runtime import distributed


class SFTObjective(SequenceObjective):
    """SFT's next-token NLL through the sequence machinery, for packed SFT batches: one sequence per
    sample, loss = -(sum of its loss-token log-probs), count = loss tokens (as padded SFT)."""

    def sequences(self, sample) -> list:
        return [(sample.ids, sample.loss_mask)]

    def loss(self, sums, counts, batch):
        loss = -sums.sum()
        return loss, counts.sum(), {"loss": loss.detach()}


class SFTFormat:
    """Samples are `aligner.data.sft.Sample`s; the model reads ids[:-1] and predicts ids[1:]."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def length(self, sample) -> int:
        return len(sample.ids) - 1

    tokens = length

    def collate(self, samples, length: int) -> dict:
        return collate(samples, self.pad_id, length)


def sft_loss(logprobs: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Next-token NLL summed over loss tokens; normalised by the global loss-token count."""
    loss = token_nll_sum(logprobs, batch["loss_mask"])
    return loss, batch["loss_mask"].sum(), {"loss": loss}


def sft_forward_step(vocab_size: int):
    """The forward step of padded SFT batches (one sample per row)."""
    return make_forward_step(label_logprobs(vocab_size), token_reduction(sft_loss))


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "sft"))


def run(cfg, condition=None, extra_meta: dict | None = None) -> None:
    """One rank of `aligner train sft` with a validated config. `condition(record, tokenizer)` gives
    ids to put at the start of each sample outside the loss (SteerLM), `extra_meta` goes into every
    checkpoint's metadata."""
    m = cfg.model
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)
    d = cfg.data
    prefix = None if condition is None else (lambda record: condition(record, tokenizer))

    def load(path):
        return load_sft_dataset(path, tokenizer, d.format, d.max_length, d.overlong, prefix=prefix)

    train, val = load(d.train_path), (load(d.val_path) if d.val_path else None)
    if packed:  # several samples per row: the sequence machinery of the preference trainers
        objective = SFTObjective()
        model, optimizer, scheduler = wrap_for_training(build_policy(m, vocab_size), m, cfg.optim)
        trainer = SequenceTrainer(cfg, model, optimizer, scheduler, sequence_loss_step(objective.loss, vocab_size),
                                    train, val, SequenceFormat(objective, tokenizer.pad_token_id), vocab_size,
                                    tokenizer, extra_meta=extra_meta, algorithm=objective, reference_mode=None,
                                    packing={"packed": True, "capacity": d.pack_length})
    else:
        model, optimizer, scheduler = wrap_for_training(build_gpt(m, vocab_size), m, cfg.optim)
        trainer = Trainer(cfg, model, optimizer, scheduler, sft_forward_step(vocab_size), train, val,
                          SFTFormat(tokenizer.pad_token_id), vocab_size, tokenizer, extra_meta=extra_meta)
    trainer.fit()
    distributed.shutdown()
