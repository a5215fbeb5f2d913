"""Every torch.distributed collective of aligner goes through here (tests/integration/test_collectives.py scans
for direct calls), so that a GPU run can never hand NCCL a CPU tensor.

Convention: a tensor is moved to its process group's device before the call (an NCCL group: the
current CUDA device; a gloo group: the CPU; a group with both, "cpu:gloo,cuda:nccl", takes either and
the tensor stays put) and results come back on the caller's device:
- in-place operations (all_reduce, broadcast, reduce, recv) copy the result back into the caller's
  tensor when it had to be moved, and return that tensor;
- gathers return new tensors on the input's device.
Object collectives take and return python objects (torch serialises them on the group's device).

`record()` lists the calls this process makes, for tests that assert every rank makes the same ones
(a rank that skips a collective its peers make hangs the job).
"""
from __future__ import annotations

import contextlib
import datetime
import pickle
from typing import Any, Iterator

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
_recording: list | None = None


def device_kind(backend: str) -> str | None:
    """"cuda" or "cpu" where a backend string (dist.get_backend) takes tensors of one device only;
    None where it takes both ("cpu:gloo,cuda:nccl")."""
    kinds = {part.split(":")[0] for part in backend.split(",") if ":" in part}
    if kinds >= {"cpu", "cuda"}:
        return None
    if ":" in backend:  # a single "device:backend" entry
        return kinds.pop()
    return "cuda" if backend == "nccl" else "cpu"


def group_device(group=None) -> torch.device | None:
    kind = device_kind(str(dist.get_backend(group)))
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return None if kind is None else torch.device("cpu")


def _placed(tensor: torch.Tensor, group) -> torch.Tensor:
    device = group_device(group)
    if device is None or tensor.device == device:
        return tensor.contiguous()
    return tensor.to(device).contiguous()


def _note(op: str, group, tensor: torch.Tensor | None = None) -> None:
    if _recording is not None:
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
        shape = (tuple(tensor.shape), str(tensor.dtype)) if tensor is not None else None
        _recording.append((op, ranks, shape))


@contextlib.contextmanager
def record() -> Iterator[list]:
    """The (operation, group ranks, (shape, dtype) or None) of every call made inside the block."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


def _in_place(op: str, tensor: torch.Tensor, group, call) -> torch.Tensor:
    _note(op, group, tensor)
    work = _placed(tensor, group)
    call(work)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    return _in_place("all_reduce", tensor, group, lambda t: dist.all_reduce(t, op=op, group=group))


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """`src` is a global rank, as in torch.distributed."""
    return _in_place("broadcast", tensor, group, lambda t: dist.broadcast(t, src=src, group=group))


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    return _in_place("reduce", tensor, group, lambda t: dist.reduce(t, dst=dst, op=op, group=group))


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on every rank), in group-rank order, on the input's device."""
    _note("all_gather", group, tensor)
    work = _placed(tensor, group)
    parts = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, work, group=group)
    return [p.to(tensor.device) for p in parts]


def all_gather_into_tensor(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0, in group-rank order, on the input's device."""
    _note("all_gather_into_tensor", group, tensor)
    work = _placed(tensor, group)
    out = torch.empty((work.shape[0] * dist.get_world_size(group), *work.shape[1:]), dtype=work.dtype,
                      device=work.device)
    dist.all_gather_into_tensor(out, work, group=group)
    return out.to(tensor.device)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    _note("send", group, tensor)
    dist.send(_placed(tensor, group), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    return _in_place("recv", tensor, group, lambda t: dist.recv(t, src=src, group=group))


def barrier(group=None) -> None:
    _note("barrier", group)
    dist.barrier(group=group)


def several_ranks() -> bool:
    """Whether this process is one rank of a world of several (else a collective has nothing to do)."""
    return dist.is_initialized() and dist.get_world_size() > 1


LONG_WAIT_S = 6 * 3600  # a lead rank that fails ends the job through its launcher; this bounds one that hangs
_waits = 0  # wait_for_rank calls of this process: every rank makes them in the same order (the store key's number)


def wait_for_rank(src: int, wait_s: float = LONG_WAIT_S) -> None:
    """Collective over the world: the other ranks wait in the rendezvous store, not in a collective, until global
    rank `src` calls it too. For a rank that works alone (rank 0 generating for the job, or awaiting rollout
    workers) for longer than the process group's timeout, which would end a collective waiting for it (NCCL's
    watchdog aborts the job); the collective that follows then starts with every rank ready."""
    global _waits
    _waits += 1
    if not several_ranks():
        return
    _note("wait_for_rank", None)
    store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the world's rendezvous store
    key = f"aligner/wait_for_rank/{_waits}"
    if dist.get_rank() == src:
        store.set(key, b"1")
    else:
        store.wait([key], datetime.timedelta(seconds=wait_s))


def broadcast_object(obj: Any, src: int, group=None) -> Any:
    """`obj` of global rank `src` on every rank of `group` (other ranks' `obj` is ignored)."""
    _note("broadcast_object", group)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group=None) -> list:
    """Every rank's `obj`, in group-rank order."""
    _note("all_gather_object", group)
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def scatter_object(objs: list | None, src: int, group=None) -> Any:
    """objs[i] (given on global rank `src`, one per group rank) on group rank i."""
    _note("scatter_object", group)
    out = [None]
    dist.scatter_object_list(out, objs, src=src, group=group)
    return out[0]



class Bridge:
    """A process group of its own between processes that are not one torch.distributed world (the trainer's
    global rank 0 and its rollout workers, aligner/generation/rollout_worker.py): gloo between CPU tensors,
    NCCL between the current CUDA devices. Bridge rank 0 hosts the rendezvous store at `address` (host:port)
    and chooses the device (`cuda` or `cpu`); the other ranks read it from the store, so every side agrees.

    Sends and rank 0's broadcasts are asynchronous (a sender never waits for a busy receiver): their buffers
    are kept until they complete (`flush` waits for them). Receives wait. Messages between two ranks arrive
    in the order they were sent."""

    def __init__(self, address: str, rank: int, size: int, device: str | None = None, timeout_s: float = 3600.0):
        host, port = address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore("aligner-bridge", self.store)
        self.rank, self.size = rank, size
        if rank == 0:
            self.store.set("aligner-bridge-device", device or "cpu")
        else:
            device = self.store.get("aligner-bridge-device").decode()
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"bridge rank 0 ({address}) chose NCCL, but bridge rank {rank} has no CUDA device")
        if device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            # the timeout goes in the options, as torch's own NCCL groups get it; without it NCCL's watchdog
            # would end a send waiting on a busy peer after its 10-minute default
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._pending: list = []  # (work, the buffers it reads)

    def _placed(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device).contiguous()

    def _keep(self, work, buffer: torch.Tensor) -> None:
        self._pending = [(w, b) for w, b in self._pending if not w.is_completed()]
        self._pending.append((work, buffer))

    def send(self, tensor: torch.Tensor, dst: int, owned: bool = False) -> None:
        _note("bridge_send", None, tensor)
        work = self._placed(tensor)
        if work is tensor and not owned:  # the caller may change its tensor before the send completes
            work = work.clone()
        self._keep(self.group.send([work], dst, 0), work)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        _note("bridge_recv", None, tensor)
        work = self._placed(tensor)
        self.group.recv([work], src, 0).wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def broadcast(self, tensor: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """Rank 0's `tensor` on every bridge rank: asynchronous on rank 0, waits elsewhere. Rank 0 sends a copy
        unless `owned` (the caller hands the tensor over and will not change it)."""
        _note("bridge_broadcast", None, tensor)
        work = self._placed(tensor)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if self.rank == 0:
            if work is tensor and not owned:
                work = work.clone()
            self._keep(self.group.broadcast([work], options), work)
            return tensor
        self.group.broadcast([work], options).wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def send_object(self, obj: Any, dst: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send(torch.tensor([data.numel()], dtype=torch.int64), dst, owned=True)
        self.send(data, dst, owned=True)

    def recv_object(self, src: int) -> Any:
        size = self.recv(torch.zeros(1, dtype=torch.int64), src)
        data = self.recv(torch.empty(int(size.item()), dtype=torch.uint8), src)
        return pickle.loads(data.numpy().tobytes())

    def flush(self) -> None:
        """Wait until every send and broadcast of this rank has completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
