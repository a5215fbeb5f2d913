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

The handler is installed first thing in `aligner train`/`aligner serve` and in every launched rank,
before torch is imported, because SIGUSR1's default action kills the process. The embedded launcher
starts its ranks with SIGUSR1 blocked, so that a request reaching a rank before its handler waits for
it instead. Servers install the same handler and never read the flag: SIGUSR1 does not stop them.
This module imports torch only when `stop_agreed` runs.
"""
from __future__ import annotations

import signal
import threading

EXIT_PREEMPTED = 75
STOP_SIGNAL = signal.SIGUSR1

_requested = threading.Event()


class Preempted(SystemExit):
    """Raised by the trainer once the checkpoint of the stop step is on disk (exit code 75)."""

    def __init__(self, step: int):
        super().__init__(EXIT_PREEMPTED)
        self.step = step

    def __str__(self) -> str:
        return f"stopped on SIGUSR1 after step {self.step}, checkpoint saved; resume with the same run_dir"


def install() -> None:
    """Catch SIGUSR1 in this process (from the main thread; elsewhere Python cannot install handlers),
    then unblock it: a request that arrived while it was blocked (see `launch`) is taken now."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(STOP_SIGNAL, lambda signum, frame: _requested.set())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [STOP_SIGNAL])


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
    import torch
    import torch.distributed as dist

    local = _requested.is_set()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
