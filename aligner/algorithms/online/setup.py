"""What every online trainer (GRPO, PPO, RS) builds on a rank before its loop: the tokenizer, the prompt
sets, the policy with its optimizer, and the generation engine over the policy's live weights."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from aligner.data.prompts import load_prompt_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.generation.backends import build_engine
from aligner.generation.types import GenerationBackend
from aligner.models.policy import build_policy
from aligner.models.training import wrap_for_training
from aligner.rewards.scoring import RewardScorer, resolve_reward_functions


@dataclass
class Policy:
    tokenizer: object
    vocab_size: int
    prompts: object
    val: object  # None without data.val_path
    model: list
    optimizer: object
    scheduler: object
    engine: GenerationBackend


def build_rl_policy(cfg) -> Policy:
    m, d = cfg.model, cfg.data
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)
    prompts = load_prompt_dataset(d.train_path, tokenizer, d.max_length, d.overlong)
    val = load_prompt_dataset(d.val_path, tokenizer, d.max_length, d.overlong) if d.val_path else None
    model, optimizer, scheduler = wrap_for_training(build_policy(m, vocab_size), m, cfg.optim)
    g = cfg.generation
    engine = build_engine(str(g.backend), model, m, vocab_size, tokenizer, batch_size=g.batch_size, decode=g.decode,
                          tokenizer_dir=cfg.tokenizer.path, checkpoint=m.pretrained)
    return Policy(tokenizer, vocab_size, prompts, val, model, optimizer, scheduler, engine)


def reward_scorers(cfg, tokenizer):
    """(scorer, val_scorer) on global rank 0, else (None, None): reward.functions and/or reward.url (a
    server that must answer before the first step), and reward.val_functions for greedy validation."""
    if dist.get_rank() != 0:
        return None, None
    r = cfg.reward
    scorer = RewardScorer(resolve_reward_functions(list(r.functions)), list(r.weights) if r.weights is not None
                          else None, workers=r.workers, url=r.url, remote_timeout_s=r.timeout_s, tokenizer=tokenizer)
    scorer.wait_ready()
    val_scorer = RewardScorer(resolve_reward_functions(list(r.val_functions)), workers=1) if r.val_functions else None
    return scorer, val_scorer
