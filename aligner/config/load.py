"""Compose a command's config with Hydra, then check it against its dataclass schema.

Unknown keys, wrong types, missing required values and cross-field conflicts all fail here,
in the launching process, before any rank starts; the message names the key.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from aligner import CONF_DIR
from aligner.config.registry import COMMAND_CONFIGS
from aligner.config.validate import validate
from aligner.errors import ConfigError, UserError
from aligner.launcher_env import outer_world_size


def _summary(error: BaseException) -> str:
    """First line of a Hydra/OmegaConf error and of its cause (Hydra puts the reason there)."""
    first = str(error).splitlines()[0].split(" To append")[0].strip()
    cause = error.__cause__ or error.__context__
    return f"{first} ({str(cause).splitlines()[0].strip()})" if cause else first


def structured(schema) -> DictConfig:
    """The schema dataclass as a typed config, with its `keyword_groups` (nodes whose names are Python
    keywords, such as `algorithm.async`, which no dataclass field can carry) added as typed nodes."""
    cfg = OmegaConf.structured(schema)
    for path, node_schema in getattr(schema, "keyword_groups", {}).items():
        parent, name = path.rsplit(".", 1)
        node = OmegaConf.select(cfg, parent)
        with open_dict(node):
            node[name] = OmegaConf.structured(node_schema)
    return cfg


@functools.cache
def _typed(schema) -> DictConfig:
    """`structured(schema)` built once per process, for the store and the merges, which copy it and never change
    it (building it took ~0.05 s, three times a composition)."""
    return structured(schema)


def _schema_merge(schema, *configs) -> DictConfig:
    try:
        cfg = OmegaConf.merge(_typed(schema), *configs)
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # resolve + find MISSING
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        if "Missing mandatory value" in msg:
            msg = f"missing required value; pass {key}=..."
        raise ConfigError(f"config key '{key}': {msg}") from None
    OmegaConf.set_struct(cfg, True)
    return cfg


@functools.cache
def _register_schema(name: str, schema) -> None:
    """Make the command's dataclass the base of its YAML (`defaults: [<name>_schema, ...]`), so Hydra itself
    type-checks every override against the schema. Only this command's, once per process: Hydra copies the whole
    store at every composition, and all 16 schemas made registering and composing ~0.75 s of every CLI run."""
    ConfigStore.instance().store(name=f"{name}_schema", node=_typed(schema))  # the store keeps a copy


def compose_config(command: str, overrides: list[str]) -> DictConfig:
    """Compose `conf/<command>.yaml` + overrides, type-check against the schema and resolve
    (interpolations frozen). Cross-field checks are the caller's: `load_config` for training
    commands, `aligner.servers.config` for servers."""
    if command not in COMMAND_CONFIGS:
        raise ConfigError(f"unknown command '{command}'; expected one of {sorted(COMMAND_CONFIGS)}")
    name, schema = COMMAND_CONFIGS[command]
    _register_schema(name, schema)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            composed = compose(config_name=name, overrides=list(overrides))
    except HydraException as e:
        raise ConfigError(f"conf/{name}.yaml with overrides {list(overrides)}: {_summary(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config key '{getattr(e, 'full_key', '?')}': {str(e).splitlines()[0]}") from None
    cfg = _schema_merge(schema, composed)
    if "model" in cfg and cfg.model.get("pretrained"):
        _adopt_checkpoint_architecture(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # freeze interpolations
    return _schema_merge(schema, cfg)  # and catch the keys that `+key=` overrides added


def load_config(command: str, overrides: list[str], world_size: int | None = None) -> DictConfig:
    """Compose, type-check, resolve and validate a training command's config."""
    cfg = compose_config(command, overrides)
    validate(cfg, world_size if world_size is not None else expected_world_size(cfg), command)
    return cfg


def _adopt_checkpoint_architecture(cfg) -> None:
    """With model.pretrained, the architecture (and vocabulary) are the checkpoint's; only the
    parallel layout and training-time options come from this config."""
    meta_path = Path(cfg.model.pretrained) / "aligner.json"
    if not meta_path.exists():
        what = "does not exist" if not meta_path.parent.exists() else "is not an aligner checkpoint (no aligner.json)"
        raise UserError(f"{cfg.model.pretrained} {what}", "model.pretrained",
                        "pass a checkpoint directory (<run_dir>/checkpoints/step_N), or import Hugging Face weights "
                        "with `aligner convert hf-to-mcore` first")
    architecture = json.loads(meta_path.read_text())["model"]
    for key, value in architecture.items():
        # training-time choices stay this run's own (`lora`: how a model is trained, not what it is)
        if key in cfg.model and key not in ("hidden_dropout", "attention_dropout", "seq_length",
                                            "max_position_embeddings", "transformer_impl", "params_dtype", "lora"):
            cfg.model[key] = value
    cfg.model.vocab_size = json.loads(meta_path.read_text())["vocab_size"]


def load_resolved(path: str | Path, command: str = "sft") -> DictConfig:
    """Re-load a resolved `config.yaml` written by `load_config` (what every rank reads)."""
    _, schema = COMMAND_CONFIGS[command]
    return _schema_merge(schema, OmegaConf.load(path))


def expected_world_size(cfg) -> int:
    """Ranks this run will have: an outer launcher's world, else nproc_per_node x Slurm nodes."""
    outer = outer_world_size()
    return outer if outer is not None else cfg.launcher.nproc_per_node * int(os.environ.get("SLURM_NNODES", "1"))
