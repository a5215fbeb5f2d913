"""Schemas of the online-RL commands (`aligner train grpo`, `aligner train reinforce`, `aligner train ppo`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING

from aligner.config.generation_schema import GenerationBackendConfig
from aligner.config.schema import (CriticTrainConfig, LauncherConfig, OptimConfig, ReferenceConfig,
                                   ServeParallelConfig, TrainRunConfig)


class PromptOverlong(StrEnum):
    drop = "drop"  # prompts longer than data.max_length are left out (their count is logged)
    error = "error"  # ... fail the run, naming file:line


@dataclass
class PromptDataConfig:
    """JSONL prompts: {"prompt": text or chat messages, ...}; every other field goes to the reward functions."""

    train_path: str = MISSING
    val_path: Optional[str] = None  # greedy val/reward/mean on these prompts (all of them)
    max_length: int = 128  # longest prompt (tokens); prompt + sampling.max_new_tokens must fit model.seq_length
    overlong: PromptOverlong = PromptOverlong.drop
    shuffle: bool = True
    packing: Optional[bool] = None  # as in preference training; null = packed on the local layer spec


class AdvantageEstimator(StrEnum):
    grpo = "grpo"
    dr_grpo = "dr_grpo"
    rloo = "rloo"
    reinforce_pp = "reinforce_pp"
    reinforce_pp_baseline = "reinforce_pp_baseline"
    gae = "gae"  # PPO: GAE(algorithm.gamma, algorithm.lam) on the critic's values


class KLEstimator(StrEnum):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"
    abs = "abs"


class KLMode(StrEnum):
    loss = "loss"  # coef x KL(policy || reference) per token, added to the loss (GRPO)
    reward = "reward"  # coef x each sample's masked-mean KL subtracted from its reward (NeMo-Aligner REINFORCE)
    none = "none"  # no reference model at all (DAPO)


class LossAggregation(StrEnum):
    token_mean = "token_mean"
    seq_mean_token_mean = "seq_mean_token_mean"
    seq_mean_token_sum = "seq_mean_token_sum"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"  # Dr. GRPO: / (sequences x sampling.max_new_tokens)


class RatioLevel(StrEnum):
    token = "token"
    sequence = "sequence"  # GSPO


class ImportanceLevel(StrEnum):
    none = "none"
    token = "token"
    sequence = "sequence"


class OldLogprobs(StrEnum):
    trainer = "trainer"  # a forward of the policy before the update (NeMo-Aligner, veRL, OpenRLHF)
    engine = "engine"  # the engine's own from sampling (TRL's PPO): one policy forward less a step


class DecodeMode(StrEnum):
    auto = "auto"
    lean = "lean"
    compiled = "compiled"
    megatron = "megatron"


@dataclass
class KLConfig:
    estimator: KLEstimator = KLEstimator.k3
    coef: float = 0.01  # the fixed coefficient, or the adaptive controller's first one
    mode: KLMode = KLMode.loss
    target: Optional[float] = None  # adaptive coefficient (Ziegler et al. 2019) aiming at this KL; None = fixed
    horizon: int = 10000  # the adaptive controller's horizon, in samples


@dataclass
class ImportanceSamplingConfig:
    """Truncated importance sampling: weights min(p_trainer / q_engine, cap) on the policy loss."""

    level: ImportanceLevel = ImportanceLevel.none
    cap: float = 2.0


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose rewards are all equal teach nothing; drop them and
    generate for more prompts, at most `max_refills` times per step."""

    enabled: bool = False
    max_refills: int = 3


@dataclass
class OverlongConfig:
    mask: bool = False  # samples cut at max_new_tokens are left out of learning
    buffer: int = 0  # DAPO's soft over-long penalty over the last `buffer` tokens before max_new_tokens (0 = off)
    factor: float = 1.0  # the penalty reaches -factor at max_new_tokens


@dataclass
class RLAlgorithmConfig:
    advantage: AdvantageEstimator = AdvantageEstimator.grpo
    num_generations: int = 4  # samples per prompt (a group)
    prompts_per_step: int = 8  # prompts per step; a step trains on prompts_per_step x num_generations samples
    baseline_ended_only: bool = False  # only samples that stopped on their own enter a group's baseline
    kl: KLConfig = field(default_factory=KLConfig)
    clip_low: float = 0.2
    clip_high: Optional[float] = None  # None = clip_low; larger = DAPO's clip-higher
    dual_clip: Optional[float] = None
    ratio_level: RatioLevel = RatioLevel.token
    aggregation: LossAggregation = LossAggregation.token_mean
    entropy_coef: float = 0.0  # entropy bonus
    importance_sampling: ImportanceSamplingConfig = field(default_factory=ImportanceSamplingConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    ppo_epochs: int = 1  # passes over a step's samples; each pass has one optimizer step per trainer.global_batch_size
    old_logprobs: OldLogprobs = OldLogprobs.trainer  # the rollout policy's log-probs of the ratio and the KL reward
    log_rollouts: int = 4  # (prompt, response, reward) rows per step in <run_dir>/rollouts/step_<N>.jsonl


@dataclass
class RLSamplingConfig:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_strings: list[str] = field(default_factory=list)


@dataclass
class RLGenerationConfig(GenerationBackendConfig):
    decode: DecodeMode = DecodeMode.auto  # the megatron engine's decode path
    batch_size: int = 64  # prompts per generate call on each data-parallel replica
    check_refit: bool = False  # after each refit compare the engine's weights with the trainer's (refit/* metrics)


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=list)  # builtin names or package.module:function
    weights: Optional[list[float]] = None  # one per function; None = 1.0 each
    url: Optional[str] = None  # host:port of an aligner reward-model or verifier server (added with weight 1)
    checkpoint: Optional[str] = None  # PPO: the reward model its embedded service co-hosts with the critic
    val_functions: list[str] = field(default_factory=list)  # scored on validation only: val/<function>/mean each
    workers: int = 4  # worker processes calling the reward functions (aligner.rewards.scoring)
    timeout_s: float = 60.0  # remote scoring


@dataclass
class RLRunConfig(TrainRunConfig):
    run_dir: str = "runs/grpo"
    data: PromptDataConfig = field(default_factory=PromptDataConfig)  # type: ignore[assignment]
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    algorithm: RLAlgorithmConfig = field(default_factory=RLAlgorithmConfig)
    sampling: RLSamplingConfig = field(default_factory=RLSamplingConfig)
    generation: RLGenerationConfig = field(default_factory=RLGenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)



# ---- PPO (`aligner train ppo`, algorithms/online/ppo_trainer.py) ---------------------------------------------------
@dataclass
class ScoreConfig:
    """What PPO does to the reward model's scores before they enter the token rewards."""

    standardize: bool = False  # (score - step mean) / step std over the step's scored samples
    clip: Optional[float] = None  # then clamp into [-clip, clip]


@dataclass
class PPOAlgorithmConfig(RLAlgorithmConfig):
    advantage: AdvantageEstimator = AdvantageEstimator.gae
    num_generations: int = 1
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True  # global masked mean / variance over every data-parallel rank
    critic_warmup_steps: int = 0  # the first steps train only the critic (rollouts, no actor update)
    mask_truncated: bool = False  # samples that did not end (cut at max_new_tokens) are left out of learning
    scores: ScoreConfig = field(default_factory=ScoreConfig)
    kl: KLConfig = field(default_factory=lambda: KLConfig(estimator=KLEstimator.k1, coef=0.02, mode=KLMode.reward))


@dataclass
class PPOCriticConfig:
    """The critic service: started by the trainer on loopback ports (embedded), or reached at `url`."""

    url: Optional[str] = None  # host:port of a running `aligner serve critic`; None = embedded
    checkpoint: Optional[str] = None  # its initial weights; None = reward.checkpoint (NeMo-Aligner's choice)
    timeout_s: float = 300.0  # a failed request is asked again until this deadline, then masked; not ready: exit 75
    save_timeout_s: float = 600.0  # critic_save / critic_load, which write or read the whole critic
    startup_timeout_s: float = 600.0  # the embedded service must be ready within this
    launcher: LauncherConfig = field(default_factory=LauncherConfig)  # its own ranks
    # its own layout; by default the actor's (the model file's), as NeMo-Aligner runs its critic
    parallel: ServeParallelConfig = field(default_factory=lambda: ServeParallelConfig(
        tensor_model_parallel_size="${model.tensor_model_parallel_size}",  # type: ignore[arg-type]
        pipeline_model_parallel_size="${model.pipeline_model_parallel_size}"))  # type: ignore[arg-type]
    trainer: CriticTrainConfig = field(default_factory=CriticTrainConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, min_lr=1e-5, warmup_steps=0,
                                                                     weight_decay=0.0))


@dataclass
class PPORunConfig(RLRunConfig):
    run_dir: str = "runs/ppo"
    algorithm: PPOAlgorithmConfig = field(default_factory=PPOAlgorithmConfig)  # type: ignore[assignment]
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)
