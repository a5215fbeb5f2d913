"""Typed Hydra configuration: dataclass schemas, strict loading and cross-field validation."""
from aligner.config.load import compose_config, load_config, load_resolved
from aligner.config.schema import (DataConfig, LauncherConfig, LoggingConfig, ModelConfig, OptimConfig, SFTRunConfig,
                                   TokenizerConfig, TrainerConfig)
from aligner.config.validate import ConfigError

__all__ = ["ConfigError", "compose_config", "load_config", "load_resolved", "DataConfig", "LauncherConfig", "LoggingConfig",
           "ModelConfig", "OptimConfig", "SFTRunConfig", "TokenizerConfig", "TrainerConfig"]
