"""Stop a training run at a checkpoint when the cluster asks, so that a requeued job loses no step.

The request is SIGUSR1: what `slurm/train.sbatch` has Slurm send to every rank before the time
limit (`--signal=USR1@600`) and at preemption, and what `scancel --signal=USR1 JOB` sends by hand.
The handler only sets a flag. The trainer asks `stop_agreed()` after each optimizer step: one
all-reduce (max) of the flag, so that every rank stops after the same step even when the signal
reached them at different moments. The trainer then saves a checkpoint and raises `Preempted`, and
the process exits with EXIT_PREEMPTED (sysexits' EX_TEMPFAIL: retry later), which the sbatch script
turns into `scontrol requeue`. A resumed run continues from that checkpoint.

SIGTERM keeps its default meaning (stop now): Slurm sends it at the hard end of a job, when a
checkpoint can no longer be waited for.

`install` runs first thing in `aligner train`/`aligner serve` and in every launched rank, before torch
is imported, because SIGUSR1's default action kills a process. It does not install a handler: it
blocks SIGUSR1 and takes it in one waiting thread. A signal mask survives fork and exec, so every
process this one starts (checkpoint writers, reward workers, tritonserver, ranks) starts with it
blocked too; Slurm signals every process of a job step, and with a handler (which exec resets) those
helpers would die instead. A request that reaches a rank before its own `install` waits for it.
Servers install the same and never read the flag: SIGUSR1 does not stop them.
This module imports torch only when `stop_agreed` runs.
"""
from __future__ import annotations

import signal
import threading

EXIT_PREEMPTED = 75
STOP_SIGNAL = signal.SIGUSR1

_requested = threading.Event()
_listeners: list = []
_waiter: threading.Thread | None = None


class Preempted(SystemExit):
    """Raised by the trainer once the checkpoint of the stop step is on disk (exit code 75)."""

    def __init__(self, step: int):
        super().__init__(EXIT_PREEMPTED)
        self.step = step

    def __str__(self) -> str:
        return f"stopped on SIGUSR1 after step {self.step}, checkpoint saved; resume with the same run_dir"


def install() -> None:
    """Block SIGUSR1 in this process and in every process and thread it starts from now on, and take it in
    a waiting thread that sets the flag and calls the `on_request` listeners. Idempotent; call it from
    the main thread before any other thread exists (their masks are copied from their creator)."""
    global _waiter
    if _waiter is not None or threading.current_thread() is not threading.main_thread():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, [STOP_SIGNAL])
    _waiter = threading.Thread(target=_take_requests, name="aligner-sigusr1", daemon=True)
    _waiter.start()


def _take_requests() -> None:
    while True:
        signal.sigwait([STOP_SIGNAL])
        _requested.set()
        for listener in list(_listeners):
            listener()


def on_request(listener) -> None:
    """Call `listener()` (from the waiting thread) at each SIGUSR1; `install` first."""
    _listeners.append(listener)


def off_request(listener) -> None:
    """Stop calling `listener` (no-op when it is not registered)."""
    if listener in _listeners:
        _listeners.remove(listener)


def requested() -> bool:
    """Whether this process has received SIGUSR1 since `install`."""
    return _requested.is_set()


def shield_exit() -> None:
    """Ignore SIGTERM from now on (once the stop checkpoint is complete): under `srun --kill-on-bad-exit`
    the first rank to exit with EXIT_PREEMPTED has srun terminate its peers, which would then end by
    signal, and srun would report that instead of EXIT_PREEMPTED."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def stop_agreed() -> bool:
    """Whether any rank has been asked to stop. Collective over the default process group."""
    import torch  # not at module level: the stop request is taken before torch is imported

    from aligner.runtime import collectives  # imports torch

    local = _requested.is_set()
    if not collectives.several_ranks():
        return local
    flag = torch.tensor([int(local)], dtype=torch.int32)
    return bool(collectives.all_reduce(flag, op=collectives.ReduceOp.MAX).item())
