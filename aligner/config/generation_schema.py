"""`generation.backend`: which engine generates, for every command that does (aligner/generation/backends.py),
and its rules: the engine is installed here, and only the megatron engine can be compared with the trainer.
`generation.placement` and `algorithm.async`: where rollouts are generated and from which weights version."""
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


class Placement(StrEnum):
    colocated = "colocated"  # the trainer's ranks generate, on the live weights, between updates
    separate = "separate"  # rollout workers of their own, sent the new weights after every step


@dataclass
class AsyncConfig:
    """Separate placement: the rollouts trained at step t come from the weights after step max(0, t-1-max_lag)."""

    max_lag: int = 0


def validate_placement(cfg) -> None:
    """generation.placement and algorithm.async: who generates, and with which weights."""
    g, m, lag = cfg.generation, cfg.model, cfg.algorithm["async"].max_lag
    if lag < 0:
        raise ConfigError(f"algorithm.async.max_lag must be >= 0 (the steps a rollout's weights may lag), got {lag}")
    if g.placement == "colocated":
        if lag:
            raise ConfigError(f"algorithm.async.max_lag={lag} needs rollout workers of their own: set "
                              f"generation.placement=separate (colocated generation always uses the live weights)")
        return
    if g.workers < 1:
        raise ConfigError(f"generation.placement=separate needs generation.workers >= 1 rollout workers, got {g.workers}")
    tp, groups = g.tensor_model_parallel_size, m.num_query_groups or m.num_attention_heads
    if tp < 1 or m.num_attention_heads % tp or groups % tp:
        raise ConfigError(f"generation.tensor_model_parallel_size={tp} must divide the model's attention heads "
                          f"({m.num_attention_heads}) and query groups ({groups})")
    if g.check_refit:
        raise ConfigError("generation.check_refit compares an in-process engine's weights with the trainer's; separate "
                          "rollout workers hold their own copy: set generation.check_refit=false")
