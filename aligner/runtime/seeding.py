"""Per-rank deterministic seeding, and capture/restore of every RNG a run draws from.

A rank's saved RNG state is filed by the device whose generator it is, so that a run resumes on
another device without feeding one device's generator state to the other's generator:
    {"format": 2,
     "cpu":  {"python", "numpy", "torch": the CPU generator, ["tracker"]},
     "cuda": {"torch": the CUDA generator, "tracker"}}          (only when taken on a CUDA host)
"tracker" is megatron's RNG tracker (one stream per TP rank, for dropout inside TP regions). It holds
states of the CUDA generator on a GPU host, and of the CPU generator under the CPU shims (P2,
runtime/cpu_shims.py), so it sits in that device's section. Restoring applies the "cpu" section on any
host (python, numpy and torch's CPU generator exist everywhere) and the section of the device it
resumes on; the other device's generators keep what `seed_everything` gave them, and one info line says so.
"""
from __future__ import annotations

import logging
import random

import numpy as np
import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

log = logging.getLogger(__name__)
FORMAT = 2


_run_seed: int | None = None


def run_seed() -> int:
    """The seed `seed_everything` was given, the same on every rank (torch's own differs by pipeline stage);
    torch's initial seed when it was not called."""
    return _run_seed if _run_seed is not None else torch.initial_seed()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU + CUDA, plus megatron's TP-rank RNG tracker).

    Ranks in one pipeline stage share the seed so that TP ranks draw identical dropout
    masks where megatron expects it; megatron's tracker offsets the TP-local stream itself.
    Pipeline stages get different seeds (seed + 100 * pp_rank), as in Megatron-LM.
    """
    global _run_seed
    _run_seed = seed
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def rng_device() -> str:
    """The device whose generator backs megatron's RNG tracker in this process."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def rng_state() -> dict:
    state = {"format": FORMAT, "cpu": {"python": random.getstate(), "numpy": np.random.get_state(),
                                       "torch": torch.get_rng_state()}}
    tracker = get_cuda_rng_tracker().get_states()
    if rng_device() == "cuda":
        state["cuda"] = {"torch": torch.cuda.get_rng_state(), "tracker": tracker}
    else:
        state["cpu"]["tracker"] = tracker
    return state


def by_device(state: dict) -> dict:
    """`state` in the current layout. Format 1 (flat: python, numpy, torch, tracker, and "cuda" on a GPU
    host) kept the tracker beside the CPU states; it held CUDA states exactly when "cuda" was saved."""
    if state.get("format") == FORMAT:
        return state
    cpu = {k: state[k] for k in ("python", "numpy", "torch")}
    if "cuda" in state:
        return {"format": FORMAT, "cpu": cpu, "cuda": {"torch": state["cuda"], "tracker": state["tracker"]}}
    return {"format": FORMAT, "cpu": {**cpu, "tracker": state["tracker"]}}


def saved_on(state: dict) -> str:
    """The device whose generator backed the tracker when `state` (current layout) was taken."""
    return "cuda" if "cuda" in state else "cpu"


def restore_plan(state: dict, here: str) -> tuple[dict, dict | None]:
    """What to restore on device `here`: (python, numpy and CPU-generator states, restored on any host;
    the tracker (+ CUDA generator) states when they were taken on `here`, else None)."""
    state = by_device(state)
    return state["cpu"], (state[here] if saved_on(state) == here else None)


def set_rng_state(state: dict) -> None:
    here = rng_device()
    cpu, same_device = restore_plan(state, here)
    random.setstate(cpu["python"])
    np.random.set_state(cpu["numpy"])
    torch.set_rng_state(cpu["torch"])
    if same_device is None:
        kept = "megatron's RNG tracker" + (" and the CUDA generator" if here == "cuda" else "")
        log.info("RNG states were saved on %s and resume on %s: python, numpy and the CPU generator are restored, "
                 "%s keep their seeded streams", saved_on(by_device(state)), here, kept)
        return
    if here == "cuda":
        torch.cuda.set_rng_state(same_device["torch"])
    get_cuda_rng_tracker().set_states(same_device["tracker"])
