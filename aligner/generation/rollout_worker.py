"""One process of a rollout worker (`generation.placement=separate`): its own copy of the policy at
`generation.tensor_model_parallel_size`, a generation engine over it, and a bridge to the trainer
(`collectives.Bridge`; the trainer's side: generation/workers.py).

    python -m aligner.launch.worker aligner.generation.rollout_worker:main CONFIG.yaml COMMAND

The worker's ranks are a torch.distributed world of their own (RANK/WORLD_SIZE/MASTER_PORT, one per TP
rank); ALIGNER_BRIDGE (host:port), ALIGNER_BRIDGE_RANK and ALIGNER_BRIDGE_SIZE place it on the bridge, whose
device (NCCL or gloo) the trainer chooses (generation/workers.py `bridge_device`). Under srun
(slurm/rl_async.sbatch) RANK, the rendezvous and ALIGNER_BRIDGE_RANK come from the task's id, ALIGNER_WORKER_HOSTS
and ALIGNER_WORKER_PORT (`slurm_worker_env`).
It serves the trainer's messages in order, until told to stop:
  weights   {version}, then per bucket {entries: [(HF name, shape, dtype), ...]} and one bridge broadcast
            (the bucket's tensors flattened into one), then {entries: None}: loaded into this rank's TP shard
  generate  {step, version, prompts, seeds, params[, records]}: every TP rank generates the same batch; TP rank 0
            answers {step, version, busy_s, wall_s} and the generator's lists: {responses, logprobs, is_end}
            (`single_turn`), or a multi-turn run's episodes (`main`'s generator from its entry `worker_main`:
            algorithms/online/multiturn.py `worker_episodes`)
  stop      {}
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch
from megatron.core import parallel_state as ps
from omegaconf import OmegaConf

from aligner.config import load_resolved
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.errors import UserError
from aligner.generation.backends import build_engine
from aligner.generation.weights import load_weight_stream
from aligner.models.policy import build_policy
from aligner.runtime import distributed
from aligner.runtime.collectives import Bridge
from aligner.runtime.seeding import seed_everything


def worker_model_config(model_cfg, tensor_parallel: int):
    """The trainer's model config as a worker holds it: its own TP, no PP/CP/sequence parallelism, and no
    adapters (the trainer streams merged weights)."""
    return OmegaConf.merge(model_cfg, {"tensor_model_parallel_size": tensor_parallel,
                                       "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                                       "sequence_parallel": False, "lora": {"rank": 0}})


def slurm_worker_env(env, tensor_parallel: int) -> dict[str, str]:
    """An srun task's place: task t is TP rank t % TP of worker t // TP, on the bridge as rank 1 + t; its
    worker's rendezvous is on that worker's first host (ALIGNER_WORKER_HOSTS, one per worker) at
    ALIGNER_WORKER_PORT + worker (several workers may share a node)."""
    task = int(env["SLURM_PROCID"])
    worker, rank = divmod(task, tensor_parallel)
    return {"RANK": str(rank), "WORLD_SIZE": str(tensor_parallel), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": env["ALIGNER_WORKER_HOSTS"].split(",")[worker],
            "MASTER_PORT": str(int(env["ALIGNER_WORKER_PORT"]) + worker), "ALIGNER_BRIDGE_RANK": str(1 + task)}


def watch_trainer(pid: int) -> None:
    """End this process when the trainer's rank 0 is gone (killed, it could not say stop): a worker waiting
    for it on the bridge would otherwise wait out the bridge's timeout."""
    def watch():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


@contextlib.contextmanager
def single_turn(cfg, engine, tokenizer):
    """The answer to a generate order: one batched `engine.generate` of its prompts."""
    def generate(message: dict) -> dict:
        rollout = engine.generate(message["prompts"], message["params"], seeds=message["seeds"])
        return {"responses": rollout.responses(), "logprobs": rollout.response_logprobs(),
                "is_end": rollout.is_end.tolist()}

    yield generate


def main(argv: list[str], generator=single_turn) -> None:
    """generator(cfg, engine, tokenizer): a context manager giving the function that answers a generate order
    with the answer's lists (joined over the workers' shares by the trainer), closed when the worker stops."""
    if "ALIGNER_TRAINER_PID" in os.environ:  # under Slurm the trainer is on another node: srun ends the workers
        watch_trainer(int(os.environ["ALIGNER_TRAINER_PID"]))
    cfg = load_resolved(argv[0], argv[1])
    g = cfg.generation
    if generator is single_turn and cfg.get("env") is not None and cfg.env.name is not None:
        raise UserError(f"env.name={cfg.env.name}: this rollout worker was started with the single-turn entry "
                        f"{__name__}:main", fix="start it with aligner.algorithms.online.multiturn:worker_main")
    if "ALIGNER_WORKER_HOSTS" in os.environ:
        os.environ.update(slurm_worker_env(os.environ, g.tensor_model_parallel_size))
    distributed.init_process_group()
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    distributed.init_model_parallel(g.tensor_model_parallel_size, 1)
    # on a GPU megatron initialises the weights under its RNG tracker, which must be seeded (the trainer's
    # weights replace them at the first refit); CPU initialisation never asks for it
    seed_everything(cfg.trainer.seed)
    model_cfg = worker_model_config(cfg.model, g.tensor_model_parallel_size)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(cfg.model, tokenizer, cfg.tokenizer.path)
    model = build_policy(model_cfg, vocab_size)
    model.requires_grad_(False)
    model.eval()
    engine = build_engine(str(g.backend), model, model_cfg, vocab_size, tokenizer, batch_size=g.batch_size,
                          decode=g.decode, tokenizer_dir=cfg.tokenizer.path)
    bridge = Bridge(os.environ["ALIGNER_BRIDGE"], int(os.environ["ALIGNER_BRIDGE_RANK"]),
                    int(os.environ["ALIGNER_BRIDGE_SIZE"]))
    try:
        # no flush after `stop`: an answer the trainer will not read (a stopped run's orders ahead) never
        # completes, and the trainer may be gone already (under Slurm nothing waits for this process)
        with generator(cfg, engine, tokenizer) as generate:
            serve(bridge, model, model_cfg, vocab_size, generate, engine,
                  answers=ps.get_tensor_model_parallel_rank() == 0)
    finally:
        distributed.shutdown()


def serve(bridge: Bridge, model, model_cfg, vocab_size: int, generate, engine, answers: bool) -> None:
    """The trainer's messages, in order, until `stop` (module doc); `generate(order)` answers a generate order."""
    version, since = None, time.perf_counter()
    while True:
        message = bridge.recv_object(0)
        kind = message["kind"]
        if kind == "stop":
            return
        if kind == "weights":
            load_weight_stream(model, _received_buckets(bridge), model_cfg, vocab_size)
            engine.refit()  # the megatron engine reads the model's own weights (a no-op); TensorRT-LLM copies them
            version = message["version"]
        elif kind == "generate":
            if message["version"] != version:
                raise RuntimeError(f"asked for step {message['step']}'s rollouts with weights version "
                                   f"{message['version']}, holding {version}")
            start = time.perf_counter()
            answer = generate(message)
            busy = time.perf_counter() - start
            if answers:
                bridge.send_object({"step": message["step"], "version": version, **answer, "busy_s": busy,
                                    "wall_s": time.perf_counter() - since}, 0)
            since = time.perf_counter()
        else:
            raise RuntimeError(f"unknown message from the trainer: {kind!r}")


def _received_buckets(bridge: Bridge):
    """The weight set's buckets as {HF name: tensor}, one at a time (a weight stream): each announced by a
    message listing its tensors, then broadcast as one flat tensor, received on the bridge's device (a GPU's under
    NCCL: the weights then go from there into the model, never through host memory); a message without entries
    ends the set."""
    while (entries := bridge.recv_object(0)["entries"]) is not None:
        dtype = getattr(torch, entries[0][2])
        sizes = [torch.Size(shape).numel() for _, shape, _ in entries]
        flat = bridge.broadcast(torch.empty(sum(sizes), dtype=dtype, device=bridge.device))
        yield {name: part.view(shape) for (name, shape, _), part in zip(entries, flat.split(sizes))}
