"""The trainer's side of separate rollout workers (`generation.placement=separate`): global rank 0 starts
`generation.workers` workers of `generation.tensor_model_parallel_size` processes each
(generation/rollout_worker.py), joins them on a bridge (`collectives.Bridge`, bridge rank 0), and then
sends them weight sets and generation orders and receives their rollouts. Every trainer rank calls
`send_weights` (the weights are gathered collectively); the rest is rank 0's alone.

A worker that dies ends the run with `RolloutWorkerLost`: one line naming the worker and its log, exit 75
(retry: the run resumes from its last checkpoint)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from aligner.errors import UserError
from aligner.launch.zygote import popen
from aligner.runtime.collectives import Bridge
from aligner.runtime.ports import free_port
from aligner.runtime.preemption import EXIT_PREEMPTED

ENTRY = "aligner.generation.rollout_worker:main"


class RolloutWorkerLost(UserError):
    exit_code = EXIT_PREEMPTED
    fix = "re-run the same command to resume from the last checkpoint"
    # the bridge may hold a weight broadcast to the lost worker that never completes, and torch's gloo destructor
    # waits for it up to the bridge's timeout (an hour; seen on the local Slurm cluster, gdb: a pt_gloo_runloop
    # thread in gloo::broadcast -> UnboundBuffer::waitSend, the main thread in ~ProcessGroupGloo)
    end_process = True


class RolloutWorkers:
    """Global rank 0: the worker processes and the bridge. `config_path`: the run's resolved config.yaml;
    `command`: its schema's name (grpo, reinforce, ppo); logs go to `log_dir`/rollout_worker_<i>.log; `entry`:
    the workers' module:function (multi-turn runs: their own, algorithms/online/multiturn.py)."""

    def __init__(self, cfg, config_path: str | Path, command: str, log_dir: str | Path, entry: str = ENTRY):
        """Starts the worker processes; `join` then waits for them."""
        g = cfg.generation
        self.count, self.tp = int(g.workers), int(g.tensor_model_parallel_size)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # under Slurm (slurm/rl_async.sbatch) srun started the workers and the bridge's address is set for all
        # sides: rank 0 only joins the bridge, and a lost worker is named from its bridge rank
        self.external = os.environ.get("ALIGNER_BRIDGE")
        address = self.external or f"127.0.0.1:{free_port()}"
        if self.external:  # NCCL when the job's plan found GPUs on both components and the trainer runs on NCCL
            self.device, gpus = ("cuda" if os.environ.get("ALIGNER_BRIDGE_DEVICE") == "cuda" and _nccl() else "cpu"), 0
        else:
            self.device, gpus = bridge_device(cfg)
        first_gpu = cfg.launcher.nproc_per_node  # the trainer's ranks hold the node's first GPUs
        self.procs, self.logs = [], []
        for worker in range(0 if self.external else self.count):
            port = free_port()
            for rank in range(self.tp):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.tp), LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE=str(self.tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           ALIGNER_BRIDGE=address, ALIGNER_BRIDGE_RANK=str(1 + worker * self.tp + rank),
                           ALIGNER_BRIDGE_SIZE=str(1 + self.count * self.tp), ALIGNER_TRAINER_PID=str(os.getpid()),
                           ALIGNER_ERROR_FILE=str(self.log_path(worker, rank).with_suffix(".error")),
                           OMP_NUM_THREADS=str(cfg.launcher.threads_per_rank))
                env.pop("SLURM_PROCID", None)
                if gpus:  # its own GPU after the trainer's; fewer GPUs than processes: shared in turn
                    env["CUDA_VISIBLE_DEVICES"] = str((first_gpu + worker * self.tp + rank) % gpus)
                    del env["LOCAL_WORLD_SIZE"]  # a process that sees one GPU, as under srun (distributed.cuda_device)
                log = open(self.log_path(worker, rank), "w")
                self.logs.append(log)
                self.procs.append(popen([sys.executable, "-m", "aligner.launch.worker", entry, str(config_path),
                                         command], env=env, stdout=log, stderr=subprocess.STDOUT))
        self.address, self.bridge = address, None
        self.lost = False  # a worker was lost: the bridge is not talked to again
        self.busy: dict[int, float] = {}  # worker -> its busy fraction over its last order

    def log_path(self, worker: int, rank: int = 0) -> Path:
        if self.external:  # srun --output's %t: the task's id in component 1
            return self.log_dir / f"rollout_worker_task_{worker * self.tp + rank}.log"
        return self.log_dir / (f"rollout_worker_{worker}.log" if rank == 0 else f"rollout_worker_{worker}_rank_{rank}.log")

    def join(self) -> None:
        """Make the bridge once the workers are up (they start while the trainer builds its own model), in a
        thread while the workers are watched: one that dies while starting ends the wait."""
        made: list = []
        thread = threading.Thread(target=lambda: made.append(Bridge(self.address, 0, 1 + self.count * self.tp,
                                                                    self.device)), daemon=True)
        thread.start()
        while thread.is_alive():
            self.check_alive()
            thread.join(0.1)
        if not made:
            raise RuntimeError("the bridge to the rollout workers could not be made (see the workers' logs in "
                               f"{self.log_dir})")
        self.bridge = made[0]

    # ---- liveness ----------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                worker, rank = divmod(i, self.tp)
                self.lost = True
                raise RolloutWorkerLost(f"rollout worker {worker} (TP rank {rank}) exited with code {proc.returncode}",
                                        f"log: {self.log_path(worker, rank)}")

    def _lost(self, error: BaseException, rank: int | None = None) -> BaseException:
        """The worker behind a failed bridge call, once its process has ended (a second at most); under Slurm
        there is no process here to poll: the bridge rank that failed names it."""
        if self.external:
            if rank is None:
                return error
            worker, tp_rank = divmod(rank - 1, self.tp)
            return RolloutWorkerLost(f"rollout worker {worker} (TP rank {tp_rank}, bridge rank {rank}) lost its "
                                     "connection", f"log: {self.log_path(worker, tp_rank)}")
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                self.check_alive()
            except RolloutWorkerLost as lost:
                return lost
            time.sleep(0.05)
        return error

    def _call(self, fn, *args, rank: int | None = None):
        try:
            return fn(*args)
        except RuntimeError as e:  # gloo: the connection to a peer broke
            self.lost = True
            raise self._lost(e, rank) from None

    def _leaders(self) -> range:
        """Bridge ranks of each worker's TP rank 0 (the one that answers)."""
        return range(1, 1 + self.count * self.tp, self.tp)

    # ---- messages ----------------------------------------------------------------------------------------
    def _tell_all(self, message: dict) -> None:
        for rank in range(1, 1 + self.count * self.tp):
            self._call(self.bridge.send_object, message, rank, rank=rank)

    def send_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        entries = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket.items()]
        self._tell_all({"entries": entries})
        self._call(self.bridge.broadcast, torch.cat([t.reshape(-1) for t in bucket.values()]), True)

    def send_weights(self, buckets, version: int) -> None:
        """Rank 0: a weight set ({HF name: full tensor} buckets) as `version`; returns once it is on its way."""
        self._tell_all({"kind": "weights", "version": version})
        for bucket in buckets:
            if bucket:
                self.send_bucket(bucket)
        self._tell_all({"entries": None})

    def order(self, step: int, version: int, prompts: list[list[int]], seeds: list[int], params,
              records: list[dict] | None = None) -> None:
        """Rank 0: step `step`'s rollouts from weights `version`, the prompts (and a multi-turn run's records)
        split over the workers in contiguous shares (worker w takes the w-th share)."""
        share = -(-len(prompts) // self.count)
        for worker in range(self.count):
            part = slice(worker * share, (worker + 1) * share)
            message = {"kind": "generate", "step": step, "version": version, "prompts": prompts[part],
                       "seeds": seeds[part], "params": params, "records": records and records[part]}
            for rank in range(self.tp):
                bridge_rank = 1 + worker * self.tp + rank
                self._call(self.bridge.send_object, message, bridge_rank, rank=bridge_rank)

    def results(self, step: int) -> dict:
        """Rank 0: step `step`'s rollouts, the workers' shares joined: their lists ({responses, logprobs,
        is_end}, or a multi-turn run's {episodes, env_s}) in worker order, busy_s summed, and version."""
        joined = {"busy_s": 0.0}
        for worker, rank in enumerate(self._leaders()):
            answer = self._call(self.bridge.recv_object, rank, rank=rank)
            if answer["step"] != step:
                raise RuntimeError(f"rollout worker {worker} answered step {answer['step']}, expected {step}")
            for key, value in answer.items():
                if isinstance(value, list):
                    joined[key] = joined.get(key, []) + value
            joined["busy_s"] += answer["busy_s"]
            joined["version"] = answer["version"]
            self.busy[worker] = answer["busy_s"] / max(answer["wall_s"], 1e-9)
        return joined

    def close(self, grace_s: float = 10.0) -> None:
        """Tell the workers to stop, then wait for them (killed after `grace_s`); once one was lost, the others
        are killed: the bridge is not talked to again."""
        try:
            if self.bridge is not None and not self.lost:
                self._tell_all({"kind": "stop"})
                self.bridge.flush()
        except BaseException:  # noqa: BLE001 - stopping anyway; a worker that already ended is no news here
            pass
        if self.lost:
            grace_s = 0.0
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.close(grace_s=1.0)



def bridge_device(cfg) -> tuple[str, int]:
    """(the bridge's device, the GPUs on this node). NCCL ("cuda") when the trainer runs on NCCL and every
    trainer rank and worker process has a GPU of its own; else gloo over CPU copies ("cpu"): NCCL refuses two
    processes on one GPU, which is how a one-GPU machine runs a trainer and a worker."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    g = cfg.generation
    own = gpus >= cfg.launcher.nproc_per_node + g.workers * g.tensor_model_parallel_size
    return ("cuda" if gpus and own and _nccl() else "cpu"), gpus


def _nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"
