"""`generation.backend`: which engine generates, for every command that does (aligner/generation/backends.py),
and its rules: the engine is installed here, and only the megatron engine can be compared with the trainer."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import StrEnum

from aligner.errors import ConfigError


class GenerationEngine(StrEnum):
    megatron = "megatron"  # MegatronEngine: in process, on the trainer's live weights (CPU and GPU)
    trtllm = "trtllm"  # TensorRT-LLM (the GPU image only; never run in this project: README, TensorRT-LLM)


@dataclass
class GenerationBackendConfig:
    backend: GenerationEngine = GenerationEngine.megatron


TRTLLM_NO_REFIT_CHECK = ("generation.check_refit compares the megatron engine's weights with the trainer's; "
                         "TensorRT-LLM holds its own copy: set generation.check_refit=false")


def validate_generation_backend(backend: str, check_refit: bool = False) -> None:
    """generation.backend=trtllm needs TensorRT-LLM on this host (looked up, not imported: importing it costs
    seconds and touches the GPU; the ranks import it through aligner.runtime.optional.require)."""
    if backend == "trtllm":
        if importlib.util.find_spec("tensorrt_llm") is None:
            raise ConfigError("generation.backend=trtllm needs TensorRT-LLM (the tensorrt_llm package), which is not "
                              "installed here: run on the GPU image built from the Dockerfile (TensorRT-LLM's release "
                              "container; not installable from PyPI), or use generation.backend=megatron")
        if check_refit:
            raise ConfigError(TRTLLM_NO_REFIT_CHECK)
