"""Process-group set-up from whichever launcher started us, and megatron parallel state.

Launchers we recognise, in order: torchrun (and our embedded launcher, which sets the same
variables), a Slurm `srun` step (SLURM_STEP_ID set, SLURM_PROCID/SLURM_NTASKS, MASTER_ADDR exported by the
sbatch script), and a plain single process (also a command in the sbatch script itself).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.errors import UsageError
from aligner.launcher_env import in_srun_step
from aligner.observe.logs import configure_logging
from aligner.runtime import collectives, cpu_shims, preemption
from aligner.runtime.cpu_memory import keep_freed_memory
from aligner.runtime.seeding import seed_everything


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def process_info_from_env(env=os.environ) -> ProcessInfo:
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun / embedded launcher
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
    elif in_srun_step(env):  # one task per device (a command in the batch script itself is one process)
        rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
        if "MASTER_ADDR" not in env:
            raise RuntimeError("running under srun with several tasks but MASTER_ADDR is not set; export it in the "
                               "sbatch script: MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)")
    else:
        rank, world, local = 0, 1, 0
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = int(env.get("MASTER_PORT", 29500))
    return ProcessInfo(rank, world, local, addr, port)


def cuda_device(local_rank: int, env, count: int) -> int:
    """This rank's CUDA device: its local rank's, modulo the devices this process sees (under srun with
    --gpus-per-task=1 each task sees one). More local ranks than devices (torchrun's LOCAL_WORLD_SIZE, or our
    launcher's) would put two ranks on one GPU, which NCCL refuses only at the first collective: refused here."""
    local_world = int(env.get("LOCAL_WORLD_SIZE", 0))
    if local_world > count:
        raise UsageError(f"{local_world} ranks on this node but {count} GPU(s) visible to them",
                         "launcher.nproc_per_node", f"start at most {count} ranks a node (one a GPU)")
    return local_rank % count


def init_process_group(timeout_s: int = 600) -> ProcessInfo:
    """gloo on CPU, NCCL on GPU. Idempotent. On CPU the process also keeps its freed memory (cpu_memory): every
    rank, trainer, server or generator alike, frees and re-allocates the same activation-sized blocks each step."""
    info = process_info_from_env()
    cpu_shims.apply()
    if not torch.cuda.is_available():
        keep_freed_memory()
    if dist.is_initialized():
        return info
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device(info.local_rank, os.environ, torch.cuda.device_count()))
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.world_size == 1:  # no rendezvous needed: an in-process store, no port to collide on
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                rank=info.rank, world_size=info.world_size, timeout=timeout)
    return info


def init_model_parallel(tp: int = 1, pp: int = 1, cp: int = 1) -> None:
    """megatron's parallel state for TP x PP x CP over this world; nothing to do when it already has that layout.
    Rebuilding it is not free: megatron's destroy_model_parallel drops its groups without destroying them, and each
    dropped gloo group keeps its threads, which wake on their own (~50 threads a rebuild of the one-rank layout)."""
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size()) == (tp, pp, cp):
            return
        ps.destroy_model_parallel()
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by TP*PP*CP = {tp}*{pp}*{cp}; launch a multiple of "
                         f"{tp * pp * cp} processes (launcher.nproc_per_node x nodes)")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)


def start_training_rank(cfg) -> None:
    """Everything a rank of a training command sets up before it builds anything: the process
    group, CPU threads, the model-parallel groups of `cfg.model`, per-rank logging and seeds, and the
    SIGUSR1 handler that stops the run at a checkpoint (runtime/preemption.py)."""
    m = cfg.model
    preemption.install()
    init_process_group()
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    init_model_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size)
    configure_logging(dist.get_rank())
    seed_everything(cfg.trainer.seed)


def shutdown() -> None:
    if dist.is_initialized():
        collectives.barrier()
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        return collectives.all_reduce(tensor, group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_group(tensor: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward. For partial sums that every rank of `group` turns
    into the same loss (context parallelism): each rank's gradient then reaches only the positions it
    holds, and the data-parallel gradient all-reduce over DP x CP adds the parts up once."""
    return _SumOverGroup.apply(tensor, group)


@torch.no_grad()
def masked_global_mean_var(values: torch.Tensor, mask: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population variance of `values` where `mask` is set, over every rank of `group`
    (advantage whitening across data parallelism). Two all-reduces: sum and count first, then the
    squared deviations from the global mean (no E[x^2] - E[x]^2 cancellation). Empty: (0, 0)."""
    valid = mask.bool()
    values = torch.where(valid, values.float(), 0.0)
    sum_count = torch.stack([values.sum(), valid.sum().float()])
    collectives.all_reduce(sum_count, group=group)
    count = sum_count[1].clamp(min=1)
    mean = sum_count[0] / count
    squares = torch.where(valid, values - mean, 0.0).pow(2).sum()
    collectives.all_reduce(squares, group=group)
    return mean, squares / count


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
