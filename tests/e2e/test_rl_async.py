"""Asynchronous RL end to end (generation.placement=separate, online/separate.py): separate workers at lag 0
train exactly what colocated generation trains (PPO's case: tests/e2e/test_ppo.py, the first-step layouts); at lag k each step's rollouts come from the weights after
step max(0, t-1-k); a SIGKILLed lagged run resumes to the uninterrupted run's metrics; a rollout worker that
dies stops the run with one line and exit 75, and the re-run matches; slurm/rl_async.sbatch on the local Slurm
cluster (trainer and worker as a heterogeneous job) stops on SIGUSR1, requeues and resumes to the same metrics."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

import pytest

from tests.conftest import (REPO, REWARDS, job_field, read_metrics, requeued_job_log, run_cli, signal_usr1,
                            sigusr1_stop_step, start_cli, wait_for_step)
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



def kill_when_logged(process, run_dir, rows: int, victim=None) -> None:
    """SIGKILL `victim()`'s pid (default: the CLI process) once `rows` metrics rows are logged."""
    wait_for_step(run_dir, rows, alive=lambda: process.poll() is None)
    os.kill(victim() if victim else process.pid, signal.SIGKILL)


def test_a_lagged_run_resumes_to_the_uninterrupted_metrics(tiny_assets, rl_assets, lag1, tmp_path):
    """Killed after step 3 (checkpoint: step 2): step 3's rollouts, ordered from version 1 before the kill, are
    regenerated from the version-1 weights kept beside the checkpoint; no sample is trained twice."""
    run_dir = tmp_path / "killed"
    args = (*STEPS, *SEPARATE, "algorithm.async.max_lag=1", "algorithm.importance_sampling.level=token")
    process = start_cli(*grpo_args(tiny_assets, rl_assets, run_dir, *args))
    kill_when_logged(process, run_dir, 3)
    process.wait()
    assert (run_dir / "checkpoints/rollout_weights/version_1.safetensors").exists()
    resumed = grpo(tiny_assets, rl_assets, run_dir, *args)
    _, straight = lag1
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for ours, ref in zip(resumed, straight):
        for key in KEYS + ("async/lag", "policy/is_truncated_fraction"):
            assert ours.get(key) == ref.get(key), (ours["step"], key)


def worker_pids(run_dir) -> list[int]:
    """The rollout worker processes of the run in RUN_DIR; not the `srun` that started them under Slurm (its
    command line names the same entry point and config)."""
    return [p.pid for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] != "srun" and any("rollout_worker:main" in a for a in p.info["cmdline"] or [])
            and any(str(run_dir) in a for a in p.info["cmdline"] or [])]


def worker_pid(run_dir) -> int:
    pids = worker_pids(run_dir)
    assert pids, "no rollout worker process found"
    return pids[0]


def test_sigusr1_stops_trainer_and_workers_at_a_checkpoint(tiny_assets, rl_assets, lag1, tmp_path):
    run_dir = tmp_path / "run"
    args = grpo_args(tiny_assets, rl_assets, run_dir, *STEPS, *SEPARATE, "algorithm.async.max_lag=1",
                     "algorithm.importance_sampling.level=token")
    process = start_cli(*args)
    wait_for_step(run_dir, 1, alive=lambda: process.poll() is None)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr[-3000:]
    stopped = sigusr1_stop_step(stderr)
    assert 1 <= stopped < 4 and (run_dir / f"checkpoints/step_{stopped:06d}").is_dir()
    assert worker_pids(run_dir) == []  # the trainer stopped its workers
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _, straight = lag1
    for ours, ref in zip(read_metrics(run_dir), straight):
        for key in KEYS + ("async/lag",):
            assert ours.get(key) == ref.get(key), (ours["step"], key)


def test_a_dead_worker_stops_the_run_with_one_line_and_the_rerun_matches(tiny_assets, rl_assets, colocated,
                                                                         tmp_path):
    run_dir = tmp_path / "run"
    args = grpo_args(tiny_assets, rl_assets, run_dir, *STEPS, *SEPARATE, f"data.val_path={rl_assets / 'val.jsonl'}",
                     "trainer.val_interval=2")
    process = start_cli(*args)
    kill_when_logged(process, run_dir, 2, victim=lambda: worker_pid(run_dir))  # once step 1 is logged
    _, stderr = process.communicate(timeout=120)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert process.returncode == 75, stderr[-3000:]
    assert len(errors) == 1 and "rollout worker 0" in errors[0] and "rollout_worker_0.log" in errors[0], stderr[-3000:]
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for ours, ref in zip(read_metrics(run_dir), colocated):
        for key in KEYS + ("val/reward/mean",):
            assert ours.get(key) == ref.get(key), (ours["step"], key)


def test_a_cp2_trainer_with_a_tp2_worker_matches_one_process(tiny_assets, rl_assets, colocated, tmp_path):
    """The trainer under context parallelism (its passes split each sequence over 2 ranks) fed by a worker of
    tensor parallelism 2: the first step equals one colocated process's (same samples, per-sample seeds)."""
    first = grpo(tiny_assets, rl_assets, tmp_path / "run", *STEPS, *SEPARATE, "trainer.max_steps=1",
                 "launcher.nproc_per_node=2", "model.context_parallel_size=2",
                 "generation.tensor_model_parallel_size=2")[-1]
    assert (tmp_path / "run/logs/rollout_worker_0_rank_1.log").exists()
    ref = colocated[1]
    for key in ("reward/mean", "response_length/mean", "fraction/ended"):
        assert first[key] == ref[key], key
    for key in ("loss", "grad_norm", "kl/mean", "entropy/mean", "advantages/std", "mismatch/kl"):
        assert first[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key



def test_dynamic_sampling_refills_with_lagged_workers_resume_and_match_colocated(tiny_assets, rl_assets, tmp_path):
    """DAPO's refills (groups of all-equal rewards dropped and replaced) are drawn from the same sampler and
    generated on the trainer's live weights: at lag 0 a separate run equals the colocated one; at lag 1 a run
    SIGKILLed after step 3 resumes (its pending order from the checkpoint) to the uninterrupted metrics."""
    dapo = (*STEPS, "algorithm.num_generations=2", "trainer.global_batch_size=8",  # pairs: often of equal length
            "algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_refills=1")
    lagged = (*SEPARATE, "algorithm.async.max_lag=1")
    runs = {name: grpo(tiny_assets, rl_assets, tmp_path / name, *dapo, *extra)
            for name, extra in (("colocated", ()), ("separate", SEPARATE), ("lagged", lagged))}
    assert sum(m["fraction/dropped_groups"] for m in runs["colocated"]) > 0  # refills happened
    for ours, ref in zip(runs["separate"], runs["colocated"]):
        for key in KEYS + ("fraction/dropped_groups",):
            assert ours.get(key) == ref.get(key), (ours["step"], key)
    run_dir = tmp_path / "killed"
    process = start_cli(*grpo_args(tiny_assets, rl_assets, run_dir, *dapo, *lagged))
    kill_when_logged(process, run_dir, 3)
    process.wait()
    resumed = grpo(tiny_assets, rl_assets, run_dir, *dapo, *lagged)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for ours, ref in zip(resumed, runs["lagged"]):
        for key in KEYS + ("fraction/dropped_groups", "async/lag"):
            assert ours.get(key) == ref.get(key), (ours["step"], key)


# ------------------------------------------------------------------ slurm/rl_async.sbatch on the local Slurm cluster
ONE_TASK = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=1"]


def submit_async_job(slurm, out, args, worker=ONE_TASK) -> str:
    """slurm/rl_async.sbatch with one task on one node for the trainer, `worker` for the workers; aligner from
    this checkout's environment on PATH, as a user's job finds it."""
    env = {**slurm, "PATH": f"{os.path.dirname(sys.executable)}:{slurm['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    submit = subprocess.run(["sbatch", "--parsable", f"--output={out}", *ONE_TASK, ":", *worker,
                             "slurm/rl_async.sbatch", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert submit.returncode == 0, submit.stderr
    return submit.stdout.strip().split(";")[0]


def test_the_async_hetjob_stops_on_usr1_requeues_and_resumes_exactly(tiny_assets, rl_assets, lag1, slurm, tmp_path):
    """Component 0 trains, component 1 is the rollout worker (lag 1); SIGUSR1 after step 1 reaches both: the
    trainer saves (with its pending order), stops the worker and exits 75, the script requeues the job, and the
    requeued job ends with the uninterrupted local run's metrics."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    args = grpo_args(tiny_assets, rl_assets, run_dir, *STEPS, "generation.workers=1", "algorithm.async.max_lag=1",
                     "algorithm.importance_sampling.level=token")[1:]
    job = submit_async_job(slurm, out, args)
    log = requeued_job_log(slurm, job, run_dir, out, 1, lambda: signal_usr1(slurm, job))
    assert "start 1; trainer on node1, rollout workers on node2" in log and "start 2;" in log, log
    assert "stopped at a checkpoint; requeueing job" in log, log
    assert 1 <= sigusr1_stop_step(log) < 4
    assert (run_dir / "logs/rollout_worker_task_0.log").exists()  # srun --output: the worker's own log
    _, straight = lag1
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # every step once, none lost
    for ours, ref in zip(metrics, straight):
        for key in KEYS + ("async/lag", "policy/is_truncated_fraction"):
            assert ours.get(key) == ref.get(key), (ours["step"], key)


def test_a_rollout_worker_lost_under_slurm_stops_the_job_at_a_checkpoint_and_the_requeued_job_matches(
        tiny_assets, rl_assets, lag1, slurm, tmp_path):
    """No local process to poll: the trainer learns of the lost worker from its bridge, names it by its bridge
    rank and log in one line, exits 75, and the script requeues the job."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    args = grpo_args(tiny_assets, rl_assets, run_dir, *STEPS, "generation.workers=1", "algorithm.async.max_lag=1",
                     "algorithm.importance_sampling.level=token")[1:]
    job = submit_async_job(slurm, out, args)
    log = requeued_job_log(slurm, job, run_dir, out, 1, lambda: os.kill(worker_pid(run_dir), signal.SIGKILL))
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rollout worker 0 (TP rank 0, bridge rank 1)" in errors[0], log
    assert str(run_dir / "logs/rollout_worker_task_0.log") in errors[0], errors
    _, straight = lag1
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for ours, ref in zip(metrics, straight):
        for key in KEYS + ("async/lag",):
            assert ours.get(key) == ref.get(key), (ours["step"], key)


def test_an_async_hetjob_with_the_wrong_worker_count_fails_before_anything_starts(tiny_assets, rl_assets, slurm,
                                                                                  tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit_async_job(slurm, out, grpo_args(tiny_assets, rl_assets, run_dir, "generation.workers=2")[1:])
    deadline = time.monotonic() + 120
    while (state := job_field(slurm, job, "JobState")) not in ("FAILED", "COMPLETED"):
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    log = out.read_text()
    assert state == "FAILED" and "error: slurm/rl_async.sbatch" in log, log
    assert "the rollout workers (component 1) have 1 tasks, but generation.workers" in log and "Traceback" not in log
    assert not run_dir.exists()
