"""A run asked to stop with SIGUSR1 saves a checkpoint at a step every rank agrees on, exits with 75,
and its resumed run ends exactly where an uninterrupted run ends: through the embedded launcher
(which passes the signal on to its ranks), and under a real local Slurm cluster running
slurm/train.sbatch unchanged (srun ranks, `scancel --signal=USR1`, the script's requeue)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from aligner.data.preference import synthetic_preferences, write_jsonl
from aligner.runtime.preemption import EXIT_PREEMPTED
from tests.conftest import (FRESH, REPO, assert_metrics_match_by_step, read_metrics, requeued_job_log, run_cli,
                            signal_usr1, sigusr1_stop_step, start_cli, wait_for_step)

MAX_STEPS = 40
COMPARED = ("loss", "accuracy", "reward/margin", "grad_norm", "lr", "consumed_samples")


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    path = tmp_path_factory.mktemp("preemption") / "prefs.jsonl"
    write_jsonl(path, synthetic_preferences(96, seed=5, max_operand=4))
    return path


def dpo_args(tiny_assets, prefs, run_dir):
    return ["dpo", f"run_dir={run_dir}", f"data.train_path={prefs}", f"tokenizer.path={tiny_assets / 'tokenizer'}",
            "logging.progress=false", "logging.tensorboard=false", f"trainer.max_steps={MAX_STEPS}",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "optim.lr=1e-3", "dpo.beta=0.5"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_assets, prefs, tmp_path_factory):
    """Metrics by step of the same DPO run at DP=2 (two ranks of the embedded launcher), never stopped."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_cli("train", *dpo_args(tiny_assets, prefs, run_dir), "launcher.nproc_per_node=2")
    assert result.returncode == 0, result.stderr[-3000:]
    return {m["step"]: m for m in read_metrics(run_dir)}


def assert_resumed_exactly(run_dir, stop_step: int, uninterrupted: dict) -> None:
    assert (run_dir / "checkpoints" / f"step_{stop_step:06d}" / "aligner.json").exists()
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))  # every step once, none lost
    assert_metrics_match_by_step(metrics, uninterrupted, COMPARED)


def test_sigusr1_through_the_launcher_stops_at_a_checkpoint_and_resumes_exactly(tiny_assets, prefs, uninterrupted,
                                                                                tmp_path):
    run_dir = tmp_path / "run"
    proc = start_cli("train", *dpo_args(tiny_assets, prefs, run_dir), "launcher.nproc_per_node=2")
    try:
        wait_for_step(run_dir, 3, lambda: proc.poll() is None)
        proc.send_signal(signal.SIGUSR1)  # to the launcher only: it passes the signal on to both ranks
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "2 ranks stopped at a checkpoint on SIGUSR1" in err
    stop_step = read_metrics(run_dir)[-1]["step"]
    assert 3 <= stop_step < MAX_STEPS

    resumed = run_cli("train", *dpo_args(tiny_assets, prefs, run_dir), "launcher.nproc_per_node=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stop_step}" in resumed.stderr
    assert_resumed_exactly(run_dir, stop_step, uninterrupted)


def test_a_single_rank_stops_the_same_way(tiny_assets, prefs, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_cli("train", *dpo_args(tiny_assets, prefs, run_dir))
    try:
        wait_for_step(run_dir, 2, lambda: proc.poll() is None)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stop_step = read_metrics(run_dir)[-1]["step"]
    assert f"stopped on SIGUSR1 after step {stop_step}, checkpoint saved" in err
    assert (run_dir / "checkpoints" / f"step_{stop_step:06d}" / "aligner.json").exists()


def shields_sigusr1(pid: int) -> bool:
    """SIGUSR1 blocked (aligner/runtime/preemption.py takes it in a waiting thread) or caught."""
    with open(f"/proc/{pid}/status") as f:
        masks = {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigBlk", "SigCgt")}
    return bool((masks["SigBlk"] | masks["SigCgt"]) & (1 << (signal.SIGUSR1 - 1)))


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_stop_asked_while_the_run_starts_is_kept(tiny_assets, prefs, tmp_path, ranks):
    """SIGUSR1 as soon as the CLI shields itself from it, before torch is imported and before any rank exists:
    the run stops after its first step, at a checkpoint (default action: the process dies)."""
    run_dir = tmp_path / "run"
    proc = start_cli("train", *dpo_args(tiny_assets, prefs, run_dir), f"launcher.nproc_per_node={ranks}",
                     env=FRESH)  # what a fresh process loads when is the point: not one forked from the zygote
    try:
        deadline = time.time() + 60
        while not shields_sigusr1(proc.pid):
            assert proc.poll() is None and time.time() < deadline, "the CLI never shielded itself from SIGUSR1"
            time.sleep(0.002)
        with open(f"/proc/{proc.pid}/maps") as f:
            assert "libtorch" not in f.read()  # shielded from the start, not once training is set up
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "step_000001" / "aligner.json").exists()


# ------------------------------------------------------------------------------ a real Slurm cluster
def test_slurm_job_stops_on_usr1_requeues_itself_and_resumes_exactly(tiny_assets, prefs, uninterrupted, slurm,
                                                                     tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    # aligner from this checkout's environment, as a user's job would find it on PATH
    env = {**slurm, "PATH": f"{os.path.dirname(sys.executable)}:{slurm['PATH']}", "OMP_NUM_THREADS": "1"}
    submit = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                             "--gpus-per-node=1", f"--output={out}", "slurm/train.sbatch",
                             *dpo_args(tiny_assets, prefs, run_dir)],
                            cwd=REPO, env=env, capture_output=True, text=True)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    log = requeued_job_log(env, job, run_dir, out, 3, lambda: signal_usr1(env, job))
    assert "start 1 on node[1-2]" in log and "start 2 on node[1-2]" in log, log
    assert "stopped at a checkpoint; requeueing job" in log, log
    stop_step = sigusr1_stop_step(log)
    assert 3 <= stop_step < MAX_STEPS
    assert f"at step {stop_step}" in log
    assert_resumed_exactly(run_dir, stop_step, uninterrupted)
