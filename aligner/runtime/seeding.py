"""Per-rank deterministic seeding, and capture/restore of every RNG a run draws from."""
from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU + CUDA, plus megatron's TP-rank RNG tracker).

    Ranks in one pipeline stage share the seed so that TP ranks draw identical dropout
    masks where megatron expects it; megatron's tracker offsets the TP-local stream itself.
    Pipeline stages get different seeds (seed + 100 * pp_rank), as in Megatron-LM.
    """
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
