"""Serve configs: `conf/serve_<kind>.yaml` + overrides, checked against their schema
(`aligner.config.schema`) and against the checkpoint they serve, before any rank starts."""
from __future__ import annotations

import json
from pathlib import Path

from aligner.config import compose_config, load_resolved
from aligner.config.schema import validate_lora
from aligner.errors import ConfigError
from aligner.rewards import VERIFIERS

KINDS = ("reward", "critic", "verifier")


def load_serve_config(kind: str, overrides: list[str]):
    """Compose, type-check, resolve and check `aligner serve <kind>`'s config."""
    if kind not in KINDS:
        raise ConfigError(f"unknown server '{kind}'; expected one of {', '.join(KINDS)}")
    cfg = compose_config(f"serve_{kind}", overrides)
    check(kind, cfg)
    return cfg


def load_resolved_serve_config(path, kind: str):
    """Re-load the resolved config.yaml the CLI wrote (what every launched rank reads)."""
    return load_resolved(path, f"serve_{kind}")


def _checkpoint_meta(key: str, path) -> dict:
    meta = Path(path) / "aligner.json"
    if not Path(path).is_dir():
        raise ConfigError(f"{key}={path} does not exist")
    if not (Path(path) / "COMPLETE").exists() or not meta.exists():
        raise ConfigError(f"{key}={path} is not a complete aligner checkpoint; convert Hugging Face models with "
                          f"`aligner convert hf-to-mcore`")
    return json.loads(meta.read_text())


def critic_checkpoints(checkpoints_dir) -> dict[int, Path]:
    """The complete critic checkpoints in `checkpoints_dir` by the actor step recorded inside each
    (`trainer_state.actor_step`, written by `critic_save`; directory names are not trusted)."""
    from aligner.models.checkpoint import is_complete, read_metadata  # torch: `aligner serve` checks before launch

    root = Path(checkpoints_dir)
    found = {}
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if is_complete(path) and (step := read_metadata(path)["trainer_state"].get("actor_step")) is not None:
            found[int(step)] = path
    return found


def no_critic_checkpoint(step: int, checkpoints_dir, found: dict) -> str:
    """Why the critic cannot start from or load actor step `step`, in one line."""
    return (f"no critic checkpoint for actor step {step} in {checkpoints_dir} (steps saved there: "
            f"{', '.join(map(str, sorted(found))) or 'none'})")


def _outputs(meta: dict) -> int | None:
    return (meta.get("scalar_head") or {}).get("num_outputs")


def check(kind: str, cfg) -> None:
    s = cfg.server
    http = s.port
    named = {"server.port": http, "server.grpc_port": s.grpc_port if s.grpc_port is not None else http + 1,
             "server.metrics_port": s.metrics_port if s.metrics_port is not None else http + 2}
    for key, port in named.items():
        if not 1 <= port <= 65535:
            raise ConfigError(f"{key}={port} is not a TCP port (1..65535)")
    if len(set(named.values())) != 3:
        raise ConfigError(f"the HTTP, gRPC and metrics ports must differ, got {named}")
    if s.max_batch_size < 1 or s.forward_micro_batch_size < 1:
        raise ConfigError("server.max_batch_size and server.forward_micro_batch_size must be >= 1")
    if s.max_seq_length is not None and s.max_seq_length < 1:
        raise ConfigError(f"server.max_seq_length must be >= 1, got {s.max_seq_length}")
    if s.exit_timeout_s < 0 or s.max_queue_delay_us < 0:
        raise ConfigError("server.exit_timeout_s and server.max_queue_delay_us must be >= 0")
    if cfg.get("tokenizer") and not Path(cfg.tokenizer).is_dir():
        raise ConfigError(f"tokenizer={cfg.tokenizer} is not a directory")
    if kind == "verifier":
        if cfg.verifier not in VERIFIERS:
            raise ConfigError(f"verifier={cfg.verifier} is unknown; expected one of "
                              f"{', '.join(sorted(VERIFIERS))}")
        return
    p = cfg.parallel
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if mp < 1 or cfg.launcher.nproc_per_node % mp:
        raise ConfigError(f"launcher.nproc_per_node={cfg.launcher.nproc_per_node} is not a multiple of "
                          f"parallel.tensor x pipeline_model_parallel_size = {mp}")
    r = cfg.reward
    if r.standardize and not r.std > 0:
        raise ConfigError(f"reward.std must be > 0 to standardise rewards, got {r.std}")
    if kind == "reward":
        meta = _checkpoint_meta("checkpoint", cfg.checkpoint)
        if meta.get("head") != "reward":
            raise ConfigError(f"checkpoint={cfg.checkpoint} has a '{meta.get('head', 'lm')}' head, "
                              f"not a reward model's")
        reward_meta = meta
    else:
        checkpoints = Path(cfg.run_dir) / "checkpoints"
        saved = critic_checkpoints(checkpoints)
        if cfg.resume_step is not None and cfg.resume_step not in saved:
            raise ConfigError(f"resume_step={cfg.resume_step}: "
                              + no_critic_checkpoint(cfg.resume_step, checkpoints, saved))
        if cfg.checkpoint is None and not saved:
            raise ConfigError("the critic needs initial weights: pass checkpoint=DIR (a reward, language-model or "
                              "critic checkpoint), or a run_dir with critic checkpoints to resume")
        meta = _checkpoint_meta("checkpoint", cfg.checkpoint) if cfg.checkpoint else None
        reward_meta = _checkpoint_meta("reward_checkpoint", cfg.reward_checkpoint) if cfg.reward_checkpoint else None
        if reward_meta is not None and reward_meta.get("head") != "reward":
            raise ConfigError(f"reward_checkpoint={cfg.reward_checkpoint} is not a reward model")
        t = cfg.trainer
        dp = cfg.launcher.nproc_per_node // mp
        if t.micro_batch_size < 1 or t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError(f"trainer.global_batch_size={t.global_batch_size} must be a multiple of "
                              f"trainer.micro_batch_size={t.micro_batch_size} x data-parallel size {dp}")
        if t.epochs < 1 or t.loss_clip <= 0:
            raise ConfigError("trainer.epochs must be >= 1 and trainer.loss_clip > 0")
        validate_lora(cfg.lora, "lora")
    for m in (meta, reward_meta):
        if m and m["model"]["num_attention_heads"] % p.tensor_model_parallel_size:
            raise ConfigError(f"the model's {m['model']['num_attention_heads']} attention heads do not split over "
                              f"parallel.tensor_model_parallel_size={p.tensor_model_parallel_size}")
    if reward_meta is not None and r.attribute_weights is not None and _outputs(reward_meta) is not None \
            and len(r.attribute_weights) != _outputs(reward_meta):
        raise ConfigError(f"reward.attribute_weights has {len(r.attribute_weights)} entries, the reward model has "
                          f"{_outputs(reward_meta)} outputs")
