"""Typed Hydra configuration: dataclass schemas, strict loading and cross-field validation; the registry of
algorithms (registry.py)."""
from aligner.config.load import compose_config, load_config, load_resolved
from aligner.config.schema import (DataConfig, LauncherConfig, LoggingConfig, ModelConfig, OptimConfig, SFTRunConfig,
                                   TokenizerConfig, TrainerConfig)

__all__ = ["compose_config", "load_config", "load_resolved", "DataConfig", "LauncherConfig", "LoggingConfig",
           "ModelConfig", "OptimConfig", "SFTRunConfig", "TokenizerConfig", "TrainerConfig"]
