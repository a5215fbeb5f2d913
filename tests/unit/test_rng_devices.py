"""A rank's RNG state is filed by device and restored only on the device it was taken on: a CUDA
run's states (simulated here by the saved layout: on CPU, no CUDA generator state can be taken)
never reach the CPU generators, CPU -> CPU stays bitwise, and format-1 checkpoints still load."""
from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from tests.conftest import init_single_process

CUDA_STATE_BYTES = 16  # torch.cuda.get_rng_state(): a Philox seed and offset; the CPU generator's is 5056


@pytest.fixture(autouse=True)
def seeded():
    from aligner.runtime.seeding import seed_everything

    init_single_process()
    seed_everything(3)


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def cpu_draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def tracker_draw():
    with _tracker().fork():  # megatron's TP-rank stream, as dropout inside a TP region draws it
        return torch.rand(3).tolist()


def as_if_taken_on_cuda(state: dict) -> dict:
    """The layout a CUDA host writes: the same CPU states, a CUDA generator and tracker of CUDA states."""
    cpu = {k: state["cpu"][k] for k in ("python", "numpy", "torch")}
    cuda = torch.arange(CUDA_STATE_BYTES, dtype=torch.uint8)
    return {"format": 2, "cpu": cpu, "cuda": {"torch": cuda, "tracker": {name: cuda.clone() for name in
                                                                        state["cpu"]["tracker"]}}}


def test_cpu_state_layout_and_bitwise_restore():
    from aligner.runtime.seeding import rng_state, seed_everything, set_rng_state

    cpu_draws(), tracker_draw()  # move every stream off its seed
    state = rng_state()
    assert set(state) == {"format", "cpu"} and set(state["cpu"]) == {"python", "numpy", "torch", "tracker"}
    assert all(s.numel() == state["cpu"]["torch"].numel() for s in state["cpu"]["tracker"].values())  # CPU states
    expected = cpu_draws(), tracker_draw(), cpu_draws()
    seed_everything(11)
    set_rng_state(state)
    assert (cpu_draws(), tracker_draw(), cpu_draws()) == expected


def test_cuda_states_are_not_fed_to_cpu_generators(caplog):
    from aligner.runtime.seeding import rng_state, seed_everything, set_rng_state

    cpu_draws(), tracker_draw()
    state = as_if_taken_on_cuda(rng_state())
    expected_cpu = cpu_draws()
    seed_everything(11)
    seeded_tracker = {k: v.clone() for k, v in _tracker().get_states().items()}
    seeded_draw = tracker_draw()
    seed_everything(11)
    with caplog.at_level(logging.INFO, logger="aligner.runtime.seeding"):
        set_rng_state(state)
    # the tracker keeps its seeded CPU states (a 16-byte CUDA state would fail in fork())
    assert {k: v.tolist() for k, v in _tracker().get_states().items()} == \
        {k: v.tolist() for k, v in seeded_tracker.items()}
    assert cpu_draws() == expected_cpu and tracker_draw() == seeded_draw
    lines = [r.getMessage() for r in caplog.records if "RNG states were saved on" in r.getMessage()]
    assert len(lines) == 1 and "saved on cuda and resume on cpu" in lines[0]


def test_restore_plan_on_each_device():
    """Which sections a host applies: its own device's, never the other's."""
    from aligner.runtime.seeding import restore_plan, rng_state

    on_cpu = rng_state()
    on_cuda = as_if_taken_on_cuda(on_cpu)
    cpu, same = restore_plan(on_cpu, "cpu")
    assert cpu is on_cpu["cpu"] and same is on_cpu["cpu"]  # the tracker lives with the CPU states
    assert restore_plan(on_cpu, "cuda")[1] is None  # CPU -> CUDA: the CUDA generator and tracker stay seeded
    cpu, same = restore_plan(on_cuda, "cuda")
    assert cpu is on_cuda["cpu"] and same is on_cuda["cuda"]
    assert restore_plan(on_cuda, "cpu") == (on_cuda["cpu"], None)  # CUDA -> CPU


def test_format_1_checkpoints_still_load():
    """Format 1 was flat; its tracker held CUDA states exactly when a "cuda" entry was saved."""
    from aligner.runtime.seeding import by_device, rng_state, seed_everything, set_rng_state

    cpu_draws(), tracker_draw()
    state = rng_state()
    flat = {**{k: state["cpu"][k] for k in ("python", "numpy", "torch")}, "tracker": state["cpu"]["tracker"]}
    expected = cpu_draws(), tracker_draw()
    seed_everything(11)
    set_rng_state(flat)
    assert (cpu_draws(), tracker_draw()) == expected

    cuda = as_if_taken_on_cuda(state)["cuda"]
    flat_cuda = {**flat, "tracker": cuda["tracker"], "cuda": cuda["torch"]}
    assert by_device(flat_cuda)["cuda"] == cuda and "tracker" not in by_device(flat_cuda)["cpu"]
    seed_everything(11)
    seeded_draw = tracker_draw()
    seed_everything(11)
    set_rng_state(flat_cuda)
    assert cpu_draws() == expected[0] and tracker_draw() == seeded_draw


def test_free_ports_do_not_follow_the_runs_seed():
    """A run seeds python's `random` (seed_everything); ports drawn from it would be the same in two runs of one
    seed on a host (two rollout-worker bridges collided so): free_port neither reads nor moves that generator."""
    from aligner.runtime.ports import free_port

    random.seed(0)
    state = random.getstate()
    assert 20000 <= free_port() < 32000
    assert random.getstate() == state
