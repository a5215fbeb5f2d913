"""Schema and cross-field rules of `aligner train rs` (conf/rs.yaml; also read by `aligner rs-generate`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from aligner.config.generation_schema import validate_generation_backend
from aligner.config.rl_schema import PromptDataConfig, RewardConfig, RLGenerationConfig, RLSamplingConfig
from aligner.config.schema import TrainRunConfig
from aligner.errors import ConfigError


@dataclass
class RSConfig:
    prompts_per_step: int = 8  # prompts drawn per step
    num_rollouts_per_prompt: int = 4  # samples generated per prompt
    top_n: int = 1  # samples kept per prompt: the best scored (ties: the earlier sample); unscored never kept
    log_rollouts: int = 8  # samples per step (with score and kept flag) in <run_dir>/rollouts/step_<N>.jsonl


@dataclass
class RSRunConfig(TrainRunConfig):
    run_dir: str = "runs/rs"
    data: PromptDataConfig = field(default_factory=PromptDataConfig)  # type: ignore[assignment]
    rs: RSConfig = field(default_factory=RSConfig)
    sampling: RLSamplingConfig = field(default_factory=RLSamplingConfig)
    generation: RLGenerationConfig = field(default_factory=RLGenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


def validate_rs_sampling(cfg) -> None:
    """What `aligner rs-generate` needs too: rs.*, sampling, generation and reward."""
    if cfg.generation.placement != "colocated":
        raise ConfigError("rejection sampling generates with the trainer's ranks: generation.placement=separate "
                          "applies to grpo, reinforce and ppo")
    r, s = cfg.rs, cfg.sampling
    if min(r.prompts_per_step, r.num_rollouts_per_prompt, r.top_n) < 1:
        raise ConfigError("rs.prompts_per_step, rs.num_rollouts_per_prompt and rs.top_n must be >= 1")
    if r.top_n > r.num_rollouts_per_prompt:
        raise ConfigError(f"rs.top_n={r.top_n} keeps more samples than rs.num_rollouts_per_prompt="
                          f"{r.num_rollouts_per_prompt} generates; lower rs.top_n or raise the rollouts")
    if s.max_new_tokens < 1 or s.temperature <= 0:
        raise ConfigError("sampling.max_new_tokens must be >= 1 and sampling.temperature > 0 (RS samples)")
    if cfg.data.max_length + s.max_new_tokens > cfg.model.seq_length:
        raise ConfigError(f"data.max_length={cfg.data.max_length} (prompt) + sampling.max_new_tokens="
                          f"{s.max_new_tokens} exceed model.seq_length={cfg.model.seq_length}")
    w = cfg.reward
    if not (w.functions or w.url):
        raise ConfigError("no reward: set reward.functions=[name or package.module:function, ...] and/or "
                          "reward.url=host:port of a reward or verifier server")
    if w.checkpoint:
        raise ConfigError("reward.checkpoint is served by PPO's critic service; for RS serve the reward model "
                          "(`aligner serve reward checkpoint=...`) and set reward.url=host:port")
    if w.weights is not None and len(w.weights) != len(w.functions):
        raise ConfigError(f"reward.weights has {len(w.weights)} entries for {len(w.functions)} reward.functions")
    if w.workers < 1 or cfg.generation.batch_size < 1:
        raise ConfigError("reward.workers and generation.batch_size must be >= 1")
    validate_generation_backend(cfg.generation.backend, cfg.generation.check_refit)


def validate_rs(cfg) -> None:
    """`aligner train rs` (after the common training checks)."""
    validate_rs_sampling(cfg)
    r, t = cfg.rs, cfg.trainer
    kept = r.prompts_per_step * r.top_n
    if kept % t.global_batch_size:
        raise ConfigError(f"a step keeps up to rs.prompts_per_step x rs.top_n = {kept} samples, which do not split "
                          f"into optimizer steps of trainer.global_batch_size={t.global_batch_size}; use a divisor "
                          f"of {kept}")
    if cfg.model.context_parallel_size > 1 and cfg.generation.decode == "megatron":
        raise ConfigError("under context parallelism each CP rank generates whole sequences with the lean decoder "
                          "(an extra data-parallel replica of the engine); generation.decode=megatron runs megatron's "
                          "forward, whose attention splits a sequence over the CP ranks: use generation.decode=auto, "
                          "or model.context_parallel_size=1")
