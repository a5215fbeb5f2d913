"""How the ranks of a server job act together.

A server job has one or more ranks (TP x PP x DP). Global rank 0 hosts PyTriton; when a request
arrives it broadcasts a command and the request's tensors (`Broadcaster`), and then every rank runs
the same collective code (e.g. `aligner.models.scoring.forward_rows`). The other ranks sit in
`follow`, waiting for the next broadcast.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.distributed as dist

from aligner.runtime import cpu_shims
from aligner.runtime import collectives
from aligner.runtime.distributed import device

log = logging.getLogger(__name__)

STOP, REWARD, VALUES, TRAIN, SAVE, LOAD = range(6)  # broadcast commands


class Broadcaster:
    """Rank 0 -> every rank: a command code and named tensors of any dtype and shape."""

    def __init__(self):
        self.device = device()

    def send(self, command: int, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """On rank 0: broadcast; returns the tensors as every rank holds them (on the device)."""
        tensors = {k: v.to(self.device).contiguous() for k, v in (tensors or {}).items()}
        if dist.get_world_size() > 1:
            collectives.broadcast_object((command, {k: (str(v.dtype), tuple(v.shape)) for k, v in tensors.items()}), src=0)
            for value in tensors.values():
                collectives.broadcast(value, src=0)
        return tensors

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """On the other ranks: wait for rank 0's next broadcast."""
        command, header = collectives.broadcast_object(None, src=0)
        tensors = {}
        for name, (dtype, shape) in header.items():
            tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")), device=self.device)
            collectives.broadcast(tensors[name], src=0)
        return command, tensors


def follow(broadcaster: Broadcaster, handlers: dict[int, Callable[[dict], object]]) -> None:
    """The loop of every rank but 0: run each broadcast command until STOP."""
    while True:
        command, tensors = broadcaster.receive()
        if command == STOP:
            return
        handlers[command](tensors)


@contextlib.contextmanager
def on_device():
    """PyTriton calls us from its own threads, where CUDA's current device is not yet ours (and,
    on CPU, the thread-local megatron shims are not active yet)."""
    if torch.cuda.is_available():
        with torch.cuda.device(device()):
            yield
    else:
        cpu_shims.enter_thread()
        yield
