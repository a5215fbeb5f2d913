"""Supervised fine-tuning: next-token NLL on the loss-masked (assistant / output) tokens."""
from __future__ import annotations

from aligner.algorithms.lm_step import make_forward_step, sft_loss
from aligner.algorithms.trainer import Trainer


class SFTFormat:
    """Samples are `aligner.data.sft.Sample`s; the model reads ids[:-1] and predicts ids[1:]."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def length(self, sample) -> int:
        return len(sample.ids) - 1

    tokens = length

    def collate(self, samples, length: int) -> dict:
        from aligner.data.loader import collate

        return collate(samples, self.pad_id, length)


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    from aligner.config import load_resolved

    run(load_resolved(argv[0], "sft"))


def run(cfg, condition=None, extra_meta: dict | None = None) -> None:
    """One rank of `aligner train sft` with a validated config. `condition(record, tokenizer)` gives
    ids to put at the start of each sample outside the loss (SteerLM), `extra_meta` goes into every
    checkpoint's metadata."""
    from aligner.algorithms.preference import packing_enabled
    from aligner.data.sft import load_sft_dataset
    from aligner.data.tokenizer import load_tokenizer, model_vocab_size
    from aligner.models.gpt import build_gpt
    from aligner.models.training import wrap_for_training
    from aligner.runtime import distributed

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
        from aligner.algorithms import preference as p

        objective = p.SFTObjective()
        model, optimizer, scheduler = wrap_for_training(p.build_policy(m, vocab_size), m, cfg.optim)
        trainer = p.PreferenceTrainer(cfg, model, optimizer, scheduler,
                                      p.make_sequence_forward_step(objective.loss, vocab_size), train, val,
                                      p.PreferenceFormat(objective, tokenizer.pad_token_id), vocab_size, tokenizer,
                                      extra_meta=extra_meta, algorithm=objective, reference_mode=None,
                                      packing={"packed": True, "capacity": d.pack_length})
    else:
        model, optimizer, scheduler = wrap_for_training(build_gpt(m, vocab_size), m, cfg.optim)
        trainer = Trainer(cfg, model, optimizer, scheduler, make_forward_step(sft_loss, vocab_size), train, val,
                          SFTFormat(tokenizer.pad_token_id), vocab_size, tokenizer, extra_meta=extra_meta)
    trainer.fit()
    distributed.shutdown()
