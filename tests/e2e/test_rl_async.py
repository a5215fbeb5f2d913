"""Asynchronous RL end to end (generation.placement=separate, online/separate.py): separate workers at lag 0
train exactly what colocated generation trains; at lag k each step's rollouts come from the weights after
step max(0, t-1-k); a SIGKILLed lagged run resumes to the uninterrupted run's metrics; a rollout worker that
dies stops the run with one line and exit 75, and the re-run matches."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.conftest import REWARDS, read_metrics, run_cli, start_cli
from tests.e2e.test_rl_loop import grpo, grpo_args

# a reward that differs within every group (the response's length), so that every step changes the weights
STEPS = ("trainer.max_steps=4", "trainer.save_interval=2", f"reward.functions=[{REWARDS}:response_length]")
KEYS = ("loss", "grad_norm", "reward/mean", "kl/mean", "entropy/mean", "advantages/std", "response_length/mean",
        "mismatch/kl", "consumed_samples")
SEPARATE = ("generation.placement=separate", "generation.workers=1")


def versions(run_dir, step: int) -> set:
    rows = (run_dir / f"rollouts/step_{step:06d}.jsonl").read_text().splitlines()
    return {json.loads(row)["version"] for row in rows}


@pytest.fixture(scope="module")
def colocated(tiny_assets, rl_assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("colocated")
    return grpo(tiny_assets, rl_assets, run_dir, *STEPS, f"data.val_path={rl_assets / 'val.jsonl'}",
                "trainer.val_interval=2")


@pytest.fixture(scope="module")
def lag1(tiny_assets, rl_assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lag1")
    return run_dir, grpo(tiny_assets, rl_assets, run_dir, *STEPS, *SEPARATE, "algorithm.async.max_lag=1",
                         "algorithm.importance_sampling.level=token")


def test_separate_workers_at_lag_0_equal_colocated_generation(tiny_assets, rl_assets, colocated, tmp_path):
    separate = grpo(tiny_assets, rl_assets, tmp_path / "run", *STEPS, *SEPARATE,
                    f"data.val_path={rl_assets / 'val.jsonl'}", "trainer.val_interval=2")
    assert [m["step"] for m in separate] == [0, 1, 2, 3, 4]
    for ours, ref in zip(separate, colocated):
        for key in KEYS + ("val/reward/mean",):
            assert ours.get(key) == ref.get(key), (ours["step"], key)
    assert all(m["async/lag"] == 0.0 for m in separate[1:])
    assert all(0 < m["async/worker_0_busy_fraction"] <= 1 for m in separate[1:])
    assert all(m["timing/broadcast_s"] > 0 and m["timing/generation_wait_s"] > 0 for m in separate[1:])
    assert [versions(tmp_path / "run", step) for step in (1, 2, 3, 4)] == [{0}, {1}, {2}, {3}]


def test_lagged_rollouts_follow_the_schedule(lag1):
    run_dir, metrics = lag1
    assert [m["async/lag"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]  # min(t-1, k)
    assert [versions(run_dir, step) for step in (1, 2, 3, 4)] == [{0}, {0}, {1}, {2}]  # max(0, t-1-k)
    print({key: [m.get(key) for m in metrics] for key in ("reward/mean", "mismatch/kl", "policy/is_truncated_fraction")})
    assert metrics[0]["mismatch/kl"] < 1e-6 < metrics[1]["mismatch/kl"]  # step 2 trains version 0's samples
    assert all(0 <= m["policy/is_truncated_fraction"] <= 1 for m in metrics)

