"""One rank of an offline preference run (`aligner train dpo|orpo|simpo|kto`): the preference data, the
policy, and the shared sequence trainer with the algorithm's objective (`preference/losses.py`)."""
from __future__ import annotations

from aligner.algorithms.shared.sequence_trainer import (SequenceFormat, SequenceObjective, SequenceTrainer,
                                                        packing_enabled)
from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step
from aligner.data.preference import load_preference_dataset, load_unpaired_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.models.policy import build_policy
from aligner.models.training import wrap_for_training
from aligner.runtime import distributed


def run_preference(cfg, algorithm: SequenceObjective, unpaired: bool = False) -> None:
    """One rank of `aligner train <dpo|orpo|simpo|kto>` with a validated config."""
    m, d = cfg.model, cfg.data
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)

    def load(path):
        if unpaired:
            return load_unpaired_dataset(path, tokenizer, d.format, d.max_length, d.overlong)
        return load_preference_dataset(path, tokenizer, d.format, d.max_length, d.overlong,
                                       rewards=getattr(algorithm, "rewards", False))

    train, val = load(d.train_path), (load(d.val_path) if d.val_path else None)
    model, optimizer, scheduler = wrap_for_training(build_policy(m, vocab_size), m, cfg.optim)
    packing = {"packed": packed, "capacity": d.pack_length}
    mode = cfg.reference.mode if "reference" in cfg else None
    trainer = SequenceTrainer(cfg, model, optimizer, scheduler, sequence_loss_step(algorithm.loss, vocab_size),
                                train, val, SequenceFormat(algorithm, tokenizer.pad_token_id), vocab_size,
                                tokenizer, algorithm=algorithm, reference_mode=mode, packing=packing)
    trainer.fit()
    distributed.shutdown()
