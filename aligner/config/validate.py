"""Cross-field rules every training run shares (model layout, batch sizes, optimizer, trackers), and
`validate`, which runs them around the algorithm's own (its `<family>_schema.py`, named in config/registry.py).
Each message says what is wrong and how to fix it.

Closed sets (params_dtype, transformer_impl, data.format, ...) are enums in the schema, so OmegaConf
has already refused any other value, naming the key and the allowed values."""
from __future__ import annotations

import importlib.util

from aligner.config.registry import ALGORITHMS
from aligner.config.schema import validate_lora
from aligner.errors import ConfigError


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
    validate_lora(m.lora, "model.lora")
    return world_size // (tp * pp * cp)


def validate(cfg, world_size: int, algorithm: str) -> None:
    """`aligner train <algorithm>`'s config: the shared rules, the algorithm's own, then the layer spec and trackers."""
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
    lora = cfg.model.lora
    if lora.rank > 0 and not cfg.model.pretrained:
        raise ConfigError(f"model.lora.rank={lora.rank} adapts a base model: set model.pretrained=CHECKPOINT (the "
                          f"base, frozen), or model.lora.rank=0 for full training")
    if lora.rank > 0 and cfg.get("reference") is not None and cfg.reference.mode in ("model", "cpu_swap"):
        raise ConfigError(f"reference.mode={cfg.reference.mode} contradicts model.lora.rank={lora.rank}: a LoRA run's "
                          f"reference is its frozen base (the adapters off), with no copy; leave reference.mode unset")
    rules = ALGORITHMS[algorithm].validate
    if rules is not None:
        rules(cfg)
    if cfg.data.get("packing") and cfg.model.transformer_impl == "transformer_engine":
        raise ConfigError("data.packing=true needs the local layer spec (model.transformer_impl=local or auto on a "
                          "host without Transformer Engine)")
    validate_trackers(cfg.logging)


def validate_trackers(logging_cfg) -> None:
    """An experiment tracker that is turned on has its package installed (looked up, not imported)."""
    for key, value, package in (("logging.wandb.project", logging_cfg.wandb.project, "wandb"),
                                ("logging.mlflow.tracking_uri", logging_cfg.mlflow.tracking_uri, "mlflow")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}={value} needs the `{package}` package: pip install 'aligner[{package}]' "
                              f"(or unset {key})")
