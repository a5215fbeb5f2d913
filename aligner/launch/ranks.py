"""Running a collective piece of work on tp*pp ranks, from a command's process.

`run_ranks` runs an entry point (`module:function` taking argv) in this process when there is one
rank, else on `nproc` local ranks through the embedded launcher (launch/local.py). `rank_main` is
the launched rank's wrapper: it sets up the process group and model parallel state from the
argv's last two items (tp, pp) and calls the work. `single_process` is the one-rank group that
in-process work (scoring, SteerLM labelling, a one-rank `run_ranks`) runs inside.
"""
from __future__ import annotations

import contextlib
import importlib

import torch.distributed as dist

from aligner.launch.local import launch

# runtime.distributed is imported inside the functions: it imports megatron (seconds, and its warnings),
# which a command's process that only launches ranks never needs.


@contextlib.contextmanager
def single_process():
    """A one-rank process group with TP=PP=1 for in-process work; torn down afterwards if we made it."""
    from aligner.runtime.distributed import init_model_parallel, init_process_group, shutdown  # megatron

    created = not dist.is_initialized()
    init_process_group()
    if dist.get_world_size() != 1:
        raise RuntimeError("single_process() inside a multi-rank job; call the *_rank functions there instead")
    init_model_parallel(1, 1)
    try:
        yield
    finally:
        if created:
            shutdown()


def run_ranks(entry: str, args: list[str], nproc: int) -> None:
    """`entry` on `nproc` ranks: in this process for one rank, else through the local launcher."""
    if nproc == 1:
        module, function = entry.split(":")
        with single_process():
            getattr(importlib.import_module(module), function)(args, initialised=True)
        return
    launch(entry, args, nproc)


def rank_main(argv, initialised, work):
    """Shared launched-rank wrapper: process group + model parallel (tp, pp from argv[-2:])."""
    from aligner.runtime.distributed import init_model_parallel, init_process_group, shutdown  # megatron

    tp, pp = int(argv[-2]), int(argv[-1])
    if initialised:
        return work(*argv[:-2], tp=tp, pp=pp)
    init_process_group()
    init_model_parallel(tp, pp)
    try:
        work(*argv[:-2], tp=tp, pp=pp)
    finally:
        shutdown()
