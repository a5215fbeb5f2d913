"""Schemas and cross-field rules of the online-RL commands (`aligner train grpo`, `aligner train reinforce`,
`aligner train ppo`). Each `validate_<name>(cfg)` runs after the rules every training run shares
(config/validate.py); config/registry.py names which one each command runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Optional

from omegaconf import MISSING

from aligner.config.generation_schema import (AsyncConfig, GenerationBackendConfig, Placement,
                                              validate_generation_backend, validate_placement)
from aligner.config.schema import (CriticTrainConfig, LauncherConfig, LoraConfig, OptimConfig, ReferenceConfig,
                                   ServeParallelConfig, TrainRunConfig, validate_lora)
from aligner.errors import ConfigError


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
    placement: Placement = Placement.colocated
    workers: int = 1  # separate placement: rollout workers, each with its own copy of the policy and engine
    tensor_model_parallel_size: int = 1  # separate placement: each worker's tensor parallelism


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
class EnvConfig:
    """Multi-turn episodes (aligner/envs): the policy's turns interleaved with an environment's observations."""

    name: Optional[str] = None  # calculator | python | package.module:Class; null = single-turn rollouts
    max_turns: int = 4  # assistant turns per episode
    max_total_tokens: Optional[int] = None  # prompt + every turn and observation; null = model.seq_length
    timeout_s: float = 30.0  # deadline of one reset/step call
    concurrency: int = 8  # environment calls at once (worker processes)
    failure_reward: float = 0.0  # an episode whose environment raised, overran its deadline or returned garbage


@dataclass
class RLRunConfig(TrainRunConfig):
    run_dir: str = "runs/grpo"
    data: PromptDataConfig = field(default_factory=PromptDataConfig)  # type: ignore[assignment]
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    algorithm: RLAlgorithmConfig = field(default_factory=RLAlgorithmConfig)
    sampling: RLSamplingConfig = field(default_factory=RLSamplingConfig)
    generation: RLGenerationConfig = field(default_factory=RLGenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    # `async` is a Python keyword, so no dataclass field can carry it; config/load.py adds these nodes
    keyword_groups: ClassVar[dict] = {"algorithm.async": AsyncConfig}


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
    lora: LoraConfig = field(default_factory=LoraConfig)  # the critic's own adapters (its initial weights frozen)


@dataclass
class PPORunConfig(RLRunConfig):
    run_dir: str = "runs/ppo"
    algorithm: PPOAlgorithmConfig = field(default_factory=PPOAlgorithmConfig)  # type: ignore[assignment]
    critic: PPOCriticConfig = field(default_factory=PPOCriticConfig)


def validate_rl(cfg) -> None:
    """`aligner train grpo` and `aligner train reinforce`."""
    _validate_online(cfg, ppo=False)


def validate_ppo(cfg) -> None:
    """`aligner train ppo`: the online-RL rules, with the critic service's and PPO's own in their midst."""
    _validate_online(cfg, ppo=True)


def _validate_online(cfg, ppo: bool) -> None:
    a, t, s = cfg.algorithm, cfg.trainer, cfg.sampling
    if a.num_generations < 1 or a.prompts_per_step < 1 or a.ppo_epochs < 1:
        raise ConfigError("algorithm.num_generations, algorithm.prompts_per_step and algorithm.ppo_epochs must be >= 1")
    if ppo != (a.advantage == "gae"):
        raise ConfigError("algorithm.advantage=gae needs a critic: use `aligner train ppo`" if not ppo else
                          f"aligner train ppo takes its advantages from the critic (algorithm.advantage=gae), not "
                          f"{a.advantage}")
    if ppo:
        _validate_critic(cfg)
    elif cfg.reward.checkpoint:
        raise ConfigError("reward.checkpoint is served by PPO's critic service; for GRPO serve the reward model "
                          "(`aligner serve reward checkpoint=...`) and set reward.url=host:port")
    if a.num_generations < 2 and a.advantage not in ("reinforce_pp", "gae"):
        raise ConfigError(f"algorithm.advantage={a.advantage} compares the samples of a prompt's group: set "
                          f"algorithm.num_generations >= 2 (or use algorithm.advantage=reinforce_pp)")
    samples = a.prompts_per_step * a.num_generations
    if samples % t.global_batch_size:
        raise ConfigError(f"a step generates algorithm.prompts_per_step x num_generations = {samples} samples, which "
                          f"does not split into optimizer steps of trainer.global_batch_size={t.global_batch_size}; "
                          f"use a divisor of {samples}")
    if cfg.data.max_length + s.max_new_tokens > cfg.model.seq_length:
        raise ConfigError(f"data.max_length={cfg.data.max_length} (prompt) + sampling.max_new_tokens="
                          f"{s.max_new_tokens} exceed model.seq_length={cfg.model.seq_length}")
    if s.max_new_tokens < 1 or s.temperature <= 0:
        raise ConfigError("sampling.max_new_tokens must be >= 1 and sampling.temperature > 0 (RL samples)")
    if cfg.model.context_parallel_size > 1 and cfg.generation.decode == "megatron":
        raise ConfigError("under context parallelism each CP rank generates whole sequences with the lean decoder "
                          "(an extra data-parallel replica of the engine); generation.decode=megatron runs megatron's "
                          "forward, whose attention splits a sequence over the CP ranks: use generation.decode=auto, "
                          "or model.context_parallel_size=1")
    if cfg.reference.mode == "precompute":
        raise ConfigError("reference.mode=precompute does not apply to online RL (new samples every step); use "
                          "reference.mode=model or cpu_swap")
    if a.kl.coef < 0:
        raise ConfigError(f"algorithm.kl.coef must be >= 0, got {a.kl.coef}")
    if a.clip_low <= 0 or (a.clip_high is not None and a.clip_high <= 0):
        raise ConfigError("algorithm.clip_low and algorithm.clip_high must be > 0")
    if a.dual_clip is not None and a.dual_clip <= 1:
        raise ConfigError(f"algorithm.dual_clip must be > 1 (it caps the loss of negative advantages at "
                          f"dual_clip x |A|), got {a.dual_clip}")
    if a.importance_sampling.cap <= 0:
        raise ConfigError("algorithm.importance_sampling.cap must be > 0")
    if a.old_logprobs == "engine" and a.importance_sampling.level != "none":
        raise ConfigError(f"algorithm.importance_sampling.level={a.importance_sampling.level} weighs the trainer's "
                          f"log-probs against the engine's, but algorithm.old_logprobs=engine uses the engine's as "
                          f"the trainer's (every weight would be 1): set algorithm.old_logprobs=trainer")
    if a.dynamic_sampling.max_refills < 0:
        raise ConfigError("algorithm.dynamic_sampling.max_refills must be >= 0")
    if not 0 <= a.overlong.buffer < s.max_new_tokens:
        raise ConfigError(f"algorithm.overlong.buffer must be in [0, sampling.max_new_tokens={s.max_new_tokens})")
    if a.baseline_ended_only and a.advantage not in ("grpo", "dr_grpo", "rloo"):
        raise ConfigError("algorithm.baseline_ended_only applies to the group baselines grpo, dr_grpo and rloo")
    r = cfg.reward
    if not (r.functions or r.url or r.get("checkpoint")):
        raise ConfigError("no reward: set reward.functions=[name or package.module:function, ...] and/or "
                          "reward.url=host:port of a reward or verifier server"
                          + (" or reward.checkpoint=RM_DIR (served with the critic)" if ppo else ""))
    if r.weights is not None and len(r.weights) != len(r.functions):
        raise ConfigError(f"reward.weights has {len(r.weights)} entries for {len(r.functions)} reward.functions")
    if r.workers < 1:
        raise ConfigError("reward.workers must be >= 1")
    if cfg.generation.batch_size < 1:
        raise ConfigError("generation.batch_size must be >= 1")
    validate_generation_backend(cfg.generation.backend, cfg.generation.check_refit)
    validate_placement(cfg)
    validate_env(cfg)


def validate_env(cfg) -> None:
    """env.*: multi-turn episodes (the name itself is resolved before launch, in the CLI: aligner.envs)."""
    e = cfg.get("env")
    if e is None:
        return
    if e.max_turns < 1:
        raise ConfigError(f"env.max_turns must be >= 1 (assistant turns per episode), got {e.max_turns}")
    if e.timeout_s <= 0 or e.concurrency < 1:
        raise ConfigError(f"env.timeout_s must be > 0 and env.concurrency >= 1, got {e.timeout_s} and {e.concurrency}")
    seq, prompt = cfg.model.seq_length, cfg.data.max_length
    if e.max_total_tokens is not None and not prompt < e.max_total_tokens <= seq:
        raise ConfigError(f"env.max_total_tokens={e.max_total_tokens} must exceed data.max_length={prompt} (the "
                          f"prompt) and fit model.seq_length={seq}")
    if e.name is not None and cfg.algorithm.overlong.buffer:
        raise ConfigError("algorithm.overlong.buffer penalises responses near sampling.max_new_tokens, which bounds one "
                          "turn, not an episode's turns and observations: set algorithm.overlong.buffer=0 with env.name")
    if e.name is not None and cfg.algorithm.advantage == "gae":
        raise ConfigError("env.name: multi-turn episodes train with group advantages (grpo, reinforce); PPO's critic "
                          "does not value them yet")


def _validate_critic(cfg) -> None:
    """The critic service and PPO's own options."""
    a, c = cfg.algorithm, cfg.critic
    if a.dynamic_sampling.enabled:
        raise ConfigError("algorithm.dynamic_sampling drops groups of equal rewards (GRPO); PPO has no groups")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lam <= 1:
        raise ConfigError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got {a.gamma} and {a.lam}")
    if a.critic_warmup_steps < 0 or a.critic_warmup_steps >= cfg.trainer.max_steps:
        raise ConfigError(f"algorithm.critic_warmup_steps={a.critic_warmup_steps} must be in [0, trainer.max_steps="
                          f"{cfg.trainer.max_steps})")
    if a.kl.mode == "loss":
        raise ConfigError("PPO puts the KL into the token rewards (algorithm.kl.mode=reward) or leaves it out (none)")
    if a.scores.clip is not None and a.scores.clip <= 0:
        raise ConfigError(f"algorithm.scores.clip must be > 0, got {a.scores.clip}")
    validate_lora(c.lora, "critic.lora")
    if min(c.timeout_s, c.startup_timeout_s, c.save_timeout_s) <= 0:
        raise ConfigError("critic.timeout_s, critic.startup_timeout_s and critic.save_timeout_s must be > 0")
    if c.url is None:
        if c.checkpoint is None and cfg.reward.checkpoint is None:
            raise ConfigError("the embedded critic needs initial weights: set reward.checkpoint=RM_DIR (the critic "
                              "starts from the reward model) or critic.checkpoint=DIR")
        mp = c.parallel.tensor_model_parallel_size * c.parallel.pipeline_model_parallel_size
        if mp < 1 or c.launcher.nproc_per_node % mp:
            raise ConfigError(f"critic.launcher.nproc_per_node={c.launcher.nproc_per_node} is not a multiple of "
                              f"critic.parallel tensor x pipeline_model_parallel_size = {mp} (by default the "
                              f"model's layout); set critic.launcher.nproc_per_node={max(mp, 1)} or a smaller "
                              f"critic.parallel.*")
        m, ctp, cpp = cfg.model, c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size
        groups = m.num_query_groups or m.num_attention_heads
        if m.num_attention_heads % ctp or groups % ctp:
            raise ConfigError(f"critic.parallel.tensor_model_parallel_size={ctp} does not divide the model's "
                              f"{m.num_attention_heads} attention heads and {groups} query groups")
        if m.num_layers % cpp:
            raise ConfigError(f"critic.parallel.pipeline_model_parallel_size={cpp} does not divide the model's "
                              f"{m.num_layers} layers")
    else:  # reward.checkpoint then names the reward model the running service co-hosts (it scores)
        _host_port("critic.url", c.url)


def _host_port(key: str, value: str) -> None:
    host, _, port = str(value).rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key} must be host:port, got {value!r}")
