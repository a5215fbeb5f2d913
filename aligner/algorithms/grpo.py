"""`aligner train grpo` and `aligner train reinforce` (conf/grpo.yaml, conf/reinforce.yaml): one rank of
the online-RL loop (`rl_trainer.py`) with its parts built from the config: the policy and its
optimizer, the in-process generation engine on the policy's own weights, the frozen reference
(unless kl.mode=none), the reward functions (on global rank 0) and the prompt datasets."""
from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.algorithms.preference_trainer import packing_enabled
from aligner.algorithms.reference import Reference
from aligner.algorithms.rl_trainer import RLTrainer
from aligner.config import load_resolved
from aligner.data.prompts import load_prompt_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.generation.megatron_engine import MegatronEngine
from aligner.models.checkpoint import unwrap
from aligner.models.policy import build_policy
from aligner.models.sdpa_attention import all_fused
from aligner.models.training import wrap_for_training
from aligner.rewards.scoring import RewardScorer, resolve_reward_functions
from aligner.runtime import distributed


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "grpo"))


def run(cfg) -> None:
    """One rank of `aligner train grpo|reinforce` with a validated config."""
    m, d, a = cfg.model, cfg.data, cfg.algorithm
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)
    prompts = load_prompt_dataset(d.train_path, tokenizer, d.max_length, d.overlong)
    val = load_prompt_dataset(d.val_path, tokenizer, d.max_length, d.overlong) if d.val_path else None
    model, optimizer, scheduler = wrap_for_training(build_policy(m, vocab_size), m, cfg.optim)
    engine = MegatronEngine(model, m, vocab_size, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                            tokenizer=tokenizer, max_batch_size=cfg.generation.batch_size,
                            decode=str(cfg.generation.decode))
    # Built before the policy resumes, while it holds its initial weights (or from model.pretrained).
    reference = None
    if a.kl.mode != "none":
        reference = Reference(str(cfg.reference.mode), model, m, vocab_size, m.pretrained)
    scorer = None
    if dist.get_rank() == 0:
        r = cfg.reward
        scorer = RewardScorer(resolve_reward_functions(list(r.functions)),
                              list(r.weights) if r.weights is not None else None, workers=r.workers, url=r.url,
                              remote_timeout_s=r.timeout_s, tokenizer=tokenizer)
        scorer.wait_ready()
    val_scorer = None
    if dist.get_rank() == 0 and cfg.reward.val_functions:
        val_scorer = RewardScorer(resolve_reward_functions(list(cfg.reward.val_functions)), workers=1)
    flat = packed and ps.get_context_parallel_world_size() == 1 and all_fused(unwrap(model))
    trainer = RLTrainer(cfg, model, optimizer, scheduler, prompts, val, vocab_size, tokenizer, engine, scorer,
                        reference, packing={"packed": packed, "capacity": None, "flat": flat}, val_scorer=val_scorer)
    try:
        trainer.fit()
    finally:
        for s in (scorer, val_scorer):
            if s is not None:
                s.close()
    distributed.shutdown()
