"""`generation.backend`: which engine generates, for every command that does (aligner/generation/backends.py)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class GenerationEngine(StrEnum):
    megatron = "megatron"  # MegatronEngine: in process, on the trainer's live weights (CPU and GPU)
    trtllm = "trtllm"  # TensorRT-LLM (the GPU image only; never run in this project: README, TensorRT-LLM)


@dataclass
class GenerationBackendConfig:
    backend: GenerationEngine = GenerationEngine.megatron
