"""What every online trainer (GRPO, REINFORCE, PPO, RS) builds on a rank before its loop, in one place: the
tokenizer, the prompt sets, the policy with its optimizer, the generation engine over the policy's live
weights, the frozen reference (when the loss has a KL term), the reward scorers (global rank 0) and the
packing layout of its micro-batches."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from aligner.algorithms.online import multiturn
from aligner.algorithms.shared.reference import Reference, build_reference
from aligner.algorithms.shared.sequence_trainer import flat_packing
from aligner.data.prompts import load_prompt_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.generation.backends import build_engine
from aligner.generation.types import GenerationBackend
from aligner.generation.workers import ENTRY, RolloutWorkers
from aligner.models.policy import build_policy
from aligner.models.training import wrap_for_training
from aligner.rewards.scoring import RewardScorer, resolve_reward_functions


@dataclass
class OnlineRun:
    """The parts of one rank of an online run; `close` stops the reward scorers."""
    tokenizer: object
    vocab_size: int
    prompts: object
    val: object  # None without data.val_path
    model: list
    optimizer: object
    scheduler: object
    engine: GenerationBackend
    reference: Reference | None  # None without a KL term
    scorer: RewardScorer | None  # global rank 0 only, and only when the run scores with reward.functions
    val_scorer: RewardScorer | None  # reward.val_functions, global rank 0 only
    packing: dict  # {"packed", "capacity", "flat"}: build_micro_batches' layout
    workers: RolloutWorkers | None = None  # generation.placement=separate, global rank 0 only

    def trainer_args(self, cfg) -> tuple:
        """The leading arguments every online trainer takes: (cfg, model, optimizer, scheduler, prompts,
        val prompts, vocab size, tokenizer, engine)."""
        return (cfg, self.model, self.optimizer, self.scheduler, self.prompts, self.val, self.vocab_size,
                self.tokenizer, self.engine)

    def close(self) -> None:
        for scorer in (self.scorer, self.val_scorer):
            if scorer is not None:
                scorer.close()
        if self.workers is not None:
            self.workers.close()


def build_online_run(cfg, packed: bool, *, reference: bool, score: bool = True) -> OnlineRun:
    """The run's parts, built in this order: policy and engine, then the reference (while the policy
    holds its initial weights, before the trainer resumes), then the scorers. `packed`: `packing_enabled`;
    `score`: build the reward.functions scorer (PPO's scores come from its critic service instead)."""
    workers = start_rollout_workers(cfg)
    try:
        return _build(cfg, packed, reference, score, workers)
    except BaseException:
        if workers is not None:
            workers.kill()
        raise


def _build(cfg, packed: bool, reference: bool, score: bool, workers) -> OnlineRun:
    m, d = cfg.model, cfg.data
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)
    prompts = load_prompt_dataset(d.train_path, tokenizer, d.max_length, d.overlong)
    val = load_prompt_dataset(d.val_path, tokenizer, d.max_length, d.overlong) if d.val_path else None
    model, optimizer, scheduler = wrap_for_training(build_policy(m, vocab_size), m, cfg.optim)
    g = cfg.generation
    engine = build_engine(str(g.backend), model, m, vocab_size, tokenizer, batch_size=g.batch_size, decode=g.decode,
                          tokenizer_dir=cfg.tokenizer.path, checkpoint=m.pretrained)
    ref = build_reference(cfg, model, vocab_size, cfg.reference.mode) if reference else None
    scorer, val_scorer = reward_scorers(cfg, tokenizer, score)
    packing = {"packed": packed, "capacity": None, "flat": flat_packing(packed, model)}
    if workers is not None:
        workers.join()
    return OnlineRun(tokenizer, vocab_size, prompts, val, model, optimizer, scheduler, engine, ref, scorer, val_scorer,
                     packing, workers)


def start_rollout_workers(cfg) -> RolloutWorkers | None:
    """Global rank 0 under generation.placement=separate: the workers, started (they load while the trainer
    builds its model), with the run's config beside their logs."""
    if cfg.generation.get("placement", "colocated") != "separate" or dist.get_rank() != 0:
        return None
    # under Slurm srun started the workers on the config the job's plan wrote
    config = worker_config_path(cfg) if os.environ.get("ALIGNER_BRIDGE") else save_worker_config(cfg)
    return RolloutWorkers(cfg, config, worker_schema(cfg), config.parent, entry=worker_entry(cfg))


def worker_entry(cfg) -> str:
    """The workers' entry point: with env.name, workers that run whole episodes."""
    return multiturn.WORKER_ENTRY if cfg.get("env") is not None and cfg.env.name is not None else ENTRY


def worker_config_path(cfg) -> Path:
    return Path(cfg.run_dir) / "logs" / "rollout_workers.yaml"


def worker_schema(cfg) -> str:
    """The command whose schema reads the workers' config back (grpo's serves reinforce's too)."""
    return "ppo" if "critic" in cfg else "grpo"


def save_worker_config(cfg) -> Path:
    """The run's config where the rollout workers read it, beside their logs."""
    path = worker_config_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path)
    return path


def reward_scorers(cfg, tokenizer, score: bool = True):
    """(scorer, val_scorer) on global rank 0, else (None, None): reward.functions and/or reward.url (a
    server that must answer before the first step; None without `score`), and reward.val_functions for
    greedy validation."""
    if dist.get_rank() != 0:
        return None, None
    r = cfg.reward
    scorer = None
    if score:
        weights = list(r.weights) if r.weights is not None else None
        scorer = RewardScorer(resolve_reward_functions(list(r.functions)), weights, workers=r.workers, url=r.url,
                              remote_timeout_s=r.timeout_s, tokenizer=tokenizer)
        scorer.wait_ready()
    val_scorer = RewardScorer(resolve_reward_functions(list(r.val_functions)), workers=1) if r.val_functions else None
    return scorer, val_scorer
