"""Multi-turn GRPO end to end (env.name, aligner/envs): episodes with an environment between the turns train,
report their episode metrics, write their turns to the rollouts files and the report, and a SIGKILLed run
resumes to the uninterrupted run's metrics. With separate rollout workers (generation.placement=separate) the
workers run the episodes: at lag 0 the run equals the colocated one step for step; at lag 1 (with dynamic
sampling's refills, episodes on the trainer's engine) it trains on the schedule."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.conftest import job_field, read_metrics, start_cli, write_jsonl_lines
from tests.e2e.test_rl_async import KEYS, SEPARATE, kill_when_logged, submit_async_job, versions
from tests.e2e.test_rl_loop import grpo, grpo_args

EPISODES = ("env.name=tests.env_fixtures:Scripted", "env.max_turns=3", "env.concurrency=2",
            "reward.functions=[arithmetic]", "trainer.max_steps=4", "trainer.save_interval=2")
EPISODE_KEYS = ("episode/turns_mean", "episode/tool_calls_mean", "fraction/env_errors", "fraction/max_turns_reached")


@pytest.fixture(scope="module")
def args(rl_assets, tmp_path_factory):
    records = [json.loads(line) for line in (rl_assets / "prompts.jsonl").read_text().splitlines()]
    # Scripted: `tool_turns` tool turns, then the scored answer
    prompts = tmp_path_factory.mktemp("episodes") / "episodes.jsonl"
    write_jsonl_lines(prompts, [json.dumps({**r, "seed": i, "tool_turns": i % 3}) for i, r in enumerate(records)])
    return (f"data.train_path={prompts}", *EPISODES)


@pytest.fixture(scope="module")
def straight(tiny_assets, rl_assets, args, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    return run_dir, grpo(tiny_assets, rl_assets, run_dir, *args)


def rollout_rows(run_dir, step: int) -> list[dict]:
    return [json.loads(row) for row in (run_dir / f"rollouts/step_{step:06d}.jsonl").read_text().splitlines()]


def test_multiturn_grpo_trains_and_resumes_after_sigkill(tiny_assets, rl_assets, args, straight, tmp_path):
    straight_dir, straight = straight
    assert [m["step"] for m in straight] == [1, 2, 3, 4]
    assert all(1.0 < m["episode/turns_mean"] <= 3.0 and m["fraction/env_errors"] == 0.0 for m in straight)
    assert all("timing/env_s" in m and m["grad_norm"] == m["grad_norm"] for m in straight)  # learned (not NaN)
    rows = rollout_rows(straight_dir, 4)
    for row in rows:  # the turns as text: the first and the last (scored) are the model's
        assert row["turns"][0]["role"] == row["turns"][-1]["role"] == "assistant" and row["end"] == "env"
        assert row["turns"][-1]["reward"] == row["score"]
    assert any(turn["role"] != "assistant" for row in rows for turn in row["turns"])  # tool turns between
    assert 'class="turn assistant"' in (straight_dir / "report.html").read_text()  # the report shows them
    run_dir = tmp_path / "killed"
    process = start_cli(*grpo_args(tiny_assets, rl_assets, run_dir, *args))
    kill_when_logged(process, run_dir, 3)
    process.wait()
    resumed = grpo(tiny_assets, rl_assets, run_dir, *args)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for ours, ref in zip(resumed, straight):
        for key in KEYS + EPISODE_KEYS:
            assert ours.get(key) == ref.get(key), (ours["step"], key)


def test_separate_workers_run_the_episodes_at_lag_0_as_colocated(tiny_assets, rl_assets, args, straight, tmp_path):
    straight_dir, straight = straight
    separate = grpo(tiny_assets, rl_assets, tmp_path / "run", *args, *SEPARATE)
    assert [m["step"] for m in separate] == [1, 2, 3, 4]
    for ours, ref in zip(separate, straight):
        for key in KEYS + EPISODE_KEYS:
            assert ours.get(key) == ref.get(key), (ours["step"], key)
    assert all(m["async/lag"] == 0.0 and m["timing/env_s"] > 0 for m in separate)
    assert rollout_rows(tmp_path / "run", 4) == rollout_rows(straight_dir, 4)  # turns, versions and all


def test_lagged_workers_run_episodes_with_dynamic_sampling(tiny_assets, rl_assets, args, tmp_path):
    run_dir = tmp_path / "run"
    metrics = grpo(tiny_assets, rl_assets, run_dir, *args, *SEPARATE, "algorithm.async.max_lag=1",
                   "trainer.max_steps=3", "algorithm.num_generations=2", "trainer.global_batch_size=8",
                   "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_refills=1")
    print({key: [m.get(key) for m in metrics] for key in EPISODE_KEYS + ("fraction/dropped_groups", "reward/mean")})
    assert [m["async/lag"] for m in metrics] == [0.0, 1.0, 1.0]
    assert sum(m["fraction/dropped_groups"] for m in metrics) > 0  # refills happened (episodes on the trainer)
    assert all(1.0 < m["episode/turns_mean"] <= 3.0 and m["fraction/env_errors"] == 0.0 for m in metrics)
    # the workers' episodes are from version max(0, t-2), the refills' from the live t-1
    assert [versions(run_dir, t) <= {max(0, t - 2), t - 1} for t in (1, 2, 3)] == [True] * 3
    assert all("turns" in row for step in (1, 2, 3) for row in rollout_rows(run_dir, step))


def test_episodes_on_workers_of_the_slurm_job_equal_the_colocated_run(tiny_assets, rl_assets, args, straight, slurm,
                                                                      tmp_path):
    """slurm/rl_async.sbatch's plan gives srun the multi-turn workers' entry: at lag 0 the job's run equals the
    colocated one (trainer and worker one task each)."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit_async_job(slurm, out, grpo_args(tiny_assets, rl_assets, run_dir, *args, "generation.workers=1")[1:])
    try:
        deadline = time.monotonic() + 300
        while (state := job_field(slurm, job, "JobState")) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.monotonic() < deadline, state
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], env=slurm, capture_output=True)
    assert state == "COMPLETED", out.read_text()[-4000:]
    assert len(read_metrics(run_dir)) == 4
    for ours, ref in zip(read_metrics(run_dir), straight[1]):
        for key in KEYS + EPISODE_KEYS:
            assert ours.get(key) == ref.get(key), (ours["step"], key)
