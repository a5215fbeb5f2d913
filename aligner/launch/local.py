"""The embedded launcher: starts N local ranks of an entry point, the way torchrun would.

Each rank runs `python -m aligner.launch.worker <module:function> <args...>` with the usual
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables. Rank 0 writes to our
stdout/stderr, the others to `<log_dir>/rank_<r>.log`. When a rank fails, the others are
stopped and `RankFailed` carries the first failing rank's report (its `error:` line, or a bug's
traceback), so the user sees the first real error once.
SIGUSR1 (a request to stop at a checkpoint, runtime/preemption.py) is passed on to every rank; ranks
that stop that way exit with EXIT_PREEMPTED, and `launch` then raises `RanksPreempted`.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from aligner.errors import ReportedFailure, read_rank_error
from aligner.launch.zygote import popen
from aligner.runtime.ports import free_port
from aligner.runtime import preemption
from aligner.runtime.preemption import EXIT_PREEMPTED, STOP_SIGNAL


class RankFailed(ReportedFailure):
    """A rank failed; the message is its `error:` line (a user's mistake) or its traceback (a bug)."""


class RanksPreempted(RuntimeError):
    """Every rank stopped at a checkpoint on SIGUSR1 (exit code EXIT_PREEMPTED)."""


def _rank_env(rank: int, world: int, port: int, threads: int, error_file: Path) -> dict:
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ALIGNER_ERROR_FILE=str(error_file),
               ALIGNER_LOG_DIR=str(error_file.parent),  # tracebacks, warnings and rank 0's log lines
               OMP_NUM_THREADS=str(threads))
    env.pop("SLURM_PROCID", None)  # we are the launcher now, not srun
    return env


def _stop(procs, grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(entry: str, args: list[str], nproc: int, log_dir: str | Path | None = None,
           master_port: int | None = None, threads_per_rank: int = 1) -> None:
    """Run `entry` (module:function taking argv) on `nproc` local ranks; raise RankFailed on failure."""
    own_log_dir = log_dir is None  # a directory we made is ours to remove once every rank succeeded
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="aligner-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = master_port or free_port()
    procs, logs = [], []
    asked = []  # SIGUSR1 reached this process (and was passed on)

    def forward(signum, frame):
        _stop(procs)
        raise KeyboardInterrupt(f"signal {signum}")

    starting = threading.RLock()  # a request that comes while ranks start is passed on once they all exist

    def pass_on():  # from preemption's waiting thread
        with starting:
            asked.append(STOP_SIGNAL)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(STOP_SIGNAL)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ended_well = (0, EXIT_PREEMPTED)  # done, or stopped at a checkpoint with the others
    preemption.install()  # ranks start with SIGUSR1 blocked (the mask survives exec) and take it in theirs
    try:
        with starting:
            for rank in range(nproc):
                error_file = log_dir / f"rank_{rank}.error"
                error_file.unlink(missing_ok=True)
                out = None
                if rank > 0:
                    out = open(log_dir / f"rank_{rank}.log", "w")
                    logs.append(out)
                cmd = [sys.executable, "-m", "aligner.launch.worker", entry, *args]
                procs.append(popen(cmd, env=_rank_env(rank, nproc, port, threads_per_rank, error_file),
                                   stdout=out, stderr=subprocess.STDOUT if out else None))
            signal.signal(signal.SIGTERM, forward)
            signal.signal(signal.SIGINT, forward)
            preemption.on_request(pass_on)
            if preemption.requested():  # this process was asked before its ranks existed
                pass_on()
        failed = None
        while failed is None and any(p.poll() is None for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, *ended_well)), None)
            time.sleep(0.05)
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.returncode not in ended_well), None)
        if failed is not None:
            time.sleep(0.5)  # let sibling failures land, then stop the rest
            _stop(procs)
            raise _rank_failure(failed, procs, log_dir)
        if any(p.returncode == EXIT_PREEMPTED for p in procs):
            reported = _user_report(procs, log_dir)  # stopped by a user's error that exits 75, not on request
            if reported is not None:
                raise reported
            why = "on SIGUSR1" if asked else "(exit 75; rank 0 said why above)"
            raise RanksPreempted(f"{nproc} ranks stopped at a checkpoint {why}; resume with the same run_dir")
    finally:
        preemption.off_request(pass_on)
        for s, handler in previous.items():
            signal.signal(s, handler)
        for f in logs:
            f.close()
    if own_log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)


def _user_report(procs, log_dir: Path, first: int | None = None) -> RankFailed | None:
    """The one line of a rank that ended on a user's mistake (`first` before the others), whatever its exit
    code: a lost rollout worker exits 75, as a stop on request does, but only the former leaves a report."""
    ended = [r for r, p in enumerate(procs) if p.returncode not in (None, 0, -signal.SIGTERM)]
    for rank in sorted(ended, key=lambda r: r != first):
        report = read_rank_error(log_dir / f"rank_{rank}.error")
        if report and report["user"]:
            return RankFailed(report["message"], report["exit_code"])
    return None


def _rank_failure(first: int, procs, log_dir: Path) -> RankFailed:
    """The first failed rank that reported a user's mistake (its peers then fail on broken connections),
    else the first failed rank, with its traceback."""
    reported = _user_report(procs, log_dir, first)
    if reported is not None:
        return reported
    code = procs[first].returncode
    report = read_rank_error(log_dir / f"rank_{first}.error")
    detail = report["message"] if report else ""
    if not detail and (log_dir / f"rank_{first}.log").exists():
        detail = "".join((log_dir / f"rank_{first}.log").read_text().splitlines(True)[-40:])
    where = f" (log: {log_dir / f'rank_{first}.log'})" if first > 0 else ""
    return RankFailed(f"rank {first} failed with exit code {code}{where}:\n{detail.rstrip()}")
