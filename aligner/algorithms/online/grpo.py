"""`aligner train grpo` and `aligner train reinforce` (conf/grpo.yaml, conf/reinforce.yaml): one rank of
the online-RL loop (`online/rl.py`) with its parts built from the config: the policy and its
optimizer, the in-process generation engine on the policy's own weights, the frozen reference
(unless kl.mode=none), the reward functions (on global rank 0) and the prompt datasets."""
from __future__ import annotations

from megatron.core import parallel_state as ps

from aligner.algorithms.shared.sequence_trainer import packing_enabled
from aligner.algorithms.shared.reference import Reference
from aligner.algorithms.online.setup import build_rl_policy, reward_scorers
from aligner.algorithms.online.rl import RLTrainer
from aligner.config import load_resolved
from aligner.models.checkpoint import unwrap
from aligner.models.sdpa_attention import all_fused
from aligner.runtime import distributed


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "grpo"))


def run(cfg) -> None:
    """One rank of `aligner train grpo|reinforce` with a validated config."""
    m, a = cfg.model, cfg.algorithm
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    policy = build_rl_policy(cfg)
    model, vocab_size = policy.model, policy.vocab_size
    # Built before the policy resumes, while it holds its initial weights (or from model.pretrained).
    reference = None
    if a.kl.mode != "none":
        reference = Reference(str(cfg.reference.mode), model, m, vocab_size, m.pretrained)
    scorer, val_scorer = reward_scorers(cfg, policy.tokenizer)
    flat = packed and ps.get_context_parallel_world_size() == 1 and all_fused(unwrap(model))
    trainer = RLTrainer(cfg, model, policy.optimizer, policy.scheduler, policy.prompts, policy.val, vocab_size,
                        policy.tokenizer, policy.engine, scorer, reference,
                        packing={"packed": packed, "capacity": None, "flat": flat}, val_scorer=val_scorer)
    try:
        trainer.fit()
    finally:
        for s in (scorer, val_scorer):
            if s is not None:
                s.close()
    distributed.shutdown()
