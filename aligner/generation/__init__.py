"""Rollout generation: sampling maths, the in-process megatron engine, train/inference mismatch metrics.

Import the engine from `aligner.generation.megatron_engine` (it pulls in megatron); the types and the
pure functions here import only torch.
"""
from aligner.generation.types import (STOP_EOS, STOP_LENGTH, STOP_REASONS, STOP_STRING, STOP_TOKEN, GenerationBackend,
                                      Rollout, SamplingParams)

__all__ = ["GenerationBackend", "Rollout", "SamplingParams", "STOP_EOS", "STOP_LENGTH", "STOP_REASONS", "STOP_STRING",
           "STOP_TOKEN"]
