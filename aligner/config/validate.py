"""Cross-field rules. Each message says what is wrong and how to fix it.

Closed sets (params_dtype, transformer_impl, data.format, ...) are enums in the schema, so OmegaConf
has already refused any other value, naming the key and the allowed values."""
from __future__ import annotations

import importlib.util

from aligner.errors import UsageError


class ConfigError(UsageError, ValueError):
    """A config that cannot run: unknown key, wrong type, missing value or conflicting values."""


def validate_model(m, world_size: int) -> int:
    """Checks the model/parallel layout; returns the data-parallel size."""
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if min(tp, pp, cp) < 1:
        raise ConfigError(f"model.tensor/pipeline/context_parallel_size must be >= 1, got TP={tp} PP={pp} CP={cp}")
    if world_size % (tp * pp * cp):
        raise ConfigError(f"{world_size} ranks cannot be split into TP={tp} x PP={pp} x CP={cp}: set "
                          f"launcher.nproc_per_node (x nodes) to a multiple of {tp * pp * cp}")
    if m.num_attention_heads % tp:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                          f"model.tensor_model_parallel_size={tp}; pick a TP that divides the head count")
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} must be a multiple of "
                          f"model.num_query_groups={groups}")
    if groups % tp:
        raise ConfigError(f"model.num_query_groups={groups} is not divisible by "
                          f"model.tensor_model_parallel_size={tp}")
    if m.num_layers % pp:
        raise ConfigError(f"model.num_layers={m.num_layers} is not divisible by "
                          f"model.pipeline_model_parallel_size={pp}; pick a PP that divides the layer count")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by "
                          f"model.tensor_model_parallel_size={tp}")
    if cp > 1 and m.seq_length % (2 * cp):
        raise ConfigError(f"model.seq_length={m.seq_length} must be divisible by 2 x context_parallel_size = "
                          f"{2 * cp} (each CP rank holds two chunks); round it up to a multiple of {2 * cp}")
    if m.sequence_parallel and tp == 1:
        raise ConfigError("model.sequence_parallel=true needs model.tensor_model_parallel_size > 1")
    return world_size // (tp * pp * cp)


def validate(cfg, world_size: int) -> None:
    dp = validate_model(cfg.model, world_size)
    t = cfg.trainer
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("trainer.micro_batch_size and trainer.global_batch_size must be >= 1")
    if t.global_batch_size % (t.micro_batch_size * dp):
        step = t.micro_batch_size * dp
        raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} must be divisible by "
                          f"trainer.micro_batch_size={t.micro_batch_size} x data-parallel size {dp} = {step}; e.g. "
                          f"set trainer.global_batch_size={step * max(1, t.global_batch_size // step)}")
    if t.max_steps < 1:
        raise ConfigError(f"trainer.max_steps must be >= 1, got {t.max_steps}")
    if cfg.data.max_length > cfg.model.seq_length:
        raise ConfigError(f"data.max_length={cfg.data.max_length} exceeds model.seq_length={cfg.model.seq_length}")
    if cfg.launcher.nproc_per_node < 1:
        raise ConfigError("launcher.nproc_per_node must be >= 1")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}; the schedule decays "
                          f"from lr to min_lr, so set min_lr <= lr")
    if "steerlm" in cfg:
        s = cfg.steerlm
        if not s.attributes or len(set(s.attributes)) != len(s.attributes):
            raise ConfigError(f"steerlm.attributes must name each attribute once, e.g. [helpfulness,verbosity]; "
                              f"got {list(s.attributes)}")
        if s.scale < 1:
            raise ConfigError(f"steerlm.scale must be >= 1 (values are integers in [0, scale]), got {s.scale}")
    if "spin" in cfg:
        if cfg.spin.steps_per_iteration < 1 or cfg.spin.max_new_tokens < 1:
            raise ConfigError("spin.steps_per_iteration and spin.max_new_tokens must be >= 1")
        if cfg.reference.mode == "precompute":
            raise ConfigError("reference.mode=precompute does not apply to SPIN: its reference changes every "
                              "iteration; use reference.mode=model or cpu_swap")
        loss = cfg.dpo.loss_type
        if loss.startswith("rpo"):
            raise ConfigError(f"dpo.loss_type={loss} needs rewards in the data; SPIN's generated pairs have none")
        if cfg.model.context_parallel_size > 1:
            raise ConfigError("SPIN generates with the training model, and generation does not run under context "
                              "parallelism: set model.context_parallel_size=1")
        validate_generation_backend(cfg.generation.backend)
    if "rm" in cfg:
        loss = cfg.rm.loss
        if loss == "regression" and not cfg.rm.attributes:
            raise ConfigError("rm.loss=regression needs rm.attributes: the names of the labels to regress, e.g. "
                              "rm.attributes=[helpfulness,correctness]")
        if loss != "regression" and cfg.rm.attributes:
            raise ConfigError(f"rm.attributes is only used by rm.loss=regression (got rm.loss={loss})")
        if cfg.rm.center_coef < 0:
            raise ConfigError(f"rm.center_coef must be >= 0 (0 = off), got {cfg.rm.center_coef}")
        if loss == "regression" and cfg.rm.center_coef:
            raise ConfigError("rm.center_coef centres the rewards of preference pairs; rm.loss=regression has none")
    if "dpo" in cfg:
        loss, smoothing = cfg.dpo.loss_type, cfg.dpo.label_smoothing
        if smoothing and loss not in ("sigmoid", "robust"):
            raise ConfigError(f"dpo.label_smoothing applies to dpo.loss_type=sigmoid or robust, not {loss}")
        if not 0 <= smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing is a label-flip probability in [0, 0.5), got {smoothing}")
    if "algorithm" in cfg:
        validate_rl(cfg, dp)
    if "rs" in cfg:
        from aligner.config.rs_schema import validate_rs

        validate_rs(cfg)
    if "kd" in cfg:
        from aligner.config.kd_schema import validate_kd

        validate_kd(cfg)
    if cfg.data.get("packing") and cfg.model.transformer_impl == "transformer_engine":
        raise ConfigError("data.packing=true needs the local layer spec (model.transformer_impl=local or auto on a "
                          "host without Transformer Engine)")
    validate_trackers(cfg.logging)


def validate_generation_backend(backend: str, check_refit: bool = False) -> None:
    """generation.backend=trtllm needs TensorRT-LLM on this host (looked up, not imported: importing it costs
    seconds and touches the GPU; the ranks import it through aligner.runtime.optional.require)."""
    if backend == "trtllm":
        if importlib.util.find_spec("tensorrt_llm") is None:
            raise ConfigError("generation.backend=trtllm needs TensorRT-LLM (the tensorrt_llm package), which is not "
                              "installed here: run on the GPU image built from the Dockerfile (TensorRT-LLM's release "
                              "container; not installable from PyPI), or use generation.backend=megatron")
        if check_refit:
            raise ConfigError("generation.check_refit compares the megatron engine's weights with the trainer's; "
                              "TensorRT-LLM holds its own copy: set generation.check_refit=false")


def validate_trackers(logging_cfg) -> None:
    """An experiment tracker that is turned on has its package installed (looked up, not imported)."""
    for key, value, package in (("logging.wandb.project", logging_cfg.wandb.project, "wandb"),
                                ("logging.mlflow.tracking_uri", logging_cfg.mlflow.tracking_uri, "mlflow")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}={value} needs the `{package}` package: pip install 'aligner[{package}]' "
                              f"(or unset {key})")


def validate_rl(cfg, dp: int) -> None:
    """The online-RL commands (grpo, reinforce)."""
    a, t, s = cfg.algorithm, cfg.trainer, cfg.sampling
    if a.num_generations < 1 or a.prompts_per_step < 1 or a.ppo_epochs < 1:
        raise ConfigError("algorithm.num_generations, algorithm.prompts_per_step and algorithm.ppo_epochs must be >= 1")
    ppo = "critic" in cfg
    if ppo != (a.advantage == "gae"):
        raise ConfigError("algorithm.advantage=gae needs a critic: use `aligner train ppo`" if not ppo else
                          f"aligner train ppo takes its advantages from the critic (algorithm.advantage=gae), not "
                          f"{a.advantage}")
    if ppo:
        validate_ppo(cfg)
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
    if cfg.model.context_parallel_size > 1:
        raise ConfigError("online RL generates with the training model, and generation does not run under context "
                          "parallelism: set model.context_parallel_size=1")
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


def validate_ppo(cfg) -> None:
    """`aligner train ppo`: the critic service and PPO's own options (on top of validate_rl)."""
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
