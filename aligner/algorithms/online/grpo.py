"""`aligner train grpo` and `aligner train reinforce` (conf/grpo.yaml, conf/reinforce.yaml): one rank of
the online-RL loop (`online/rl.py`) with its parts built from the config: the policy and its
optimizer, the in-process generation engine on the policy's own weights, the frozen reference
(unless kl.mode=none), the reward functions (on global rank 0) and the prompt datasets."""
from __future__ import annotations

import contextlib

from aligner.algorithms.online.rl import RLTrainer
from aligner.algorithms.online.setup import build_online_run
from aligner.algorithms.shared.sequence_trainer import packing_enabled
from aligner.config import load_resolved
from aligner.runtime import distributed


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "grpo"))


def run(cfg) -> None:
    """One rank of `aligner train grpo|reinforce` with a validated config."""
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    with contextlib.closing(build_online_run(cfg, packed, reference=cfg.algorithm.kl.mode != "none")) as online:
        trainer = RLTrainer(*online.trainer_args(cfg), online.scorer, online.reference, packing=online.packing,
                            val_scorer=online.val_scorer, workers=online.workers)
        try:
            trainer.fit()
        finally:
            if trainer.env_pool is not None:
                trainer.env_pool.close()
    distributed.shutdown()
