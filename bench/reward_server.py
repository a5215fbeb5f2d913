"""Reward-server throughput on the tiny model (4 layers, hidden 128, vocab 512), sequences of
--length tokens: rows/s at batch 1, 8 and 64 through `aligner serve reward` (HTTP; one client
sending requests back to back, and --clients concurrent ones whose requests the server's dynamic
batcher may merge), against the same checkpoint run in this process (`aligner.models.scoring.forward_rows` at
TP=1, same torch thread count as the server's rank), and the per-request overhead: served latency
minus in-process latency at the same batch. Server and client share this machine's cores.

    python bench/reward_server.py [--seconds 4] [--length 64] [--clients 4] [--queue-delay-us 2000]
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

BATCHES = (1, 8, 64)


def make_checkpoint(root: Path) -> Path:
    """A randomly initialised tiny reward model with the tiny tokenizer (scores are not the point)."""
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.data.synthetic import corpus
    from aligner.data.tokenizer import build_tiny_tokenizer, load_tokenizer
    from aligner.models import checkpoint
    from aligner.models.gpt import build_gpt
    from aligner.models.heads import attach_scalar_head
    from aligner.launch.ranks import single_process
    from aligner.runtime.seeding import seed_everything

    tokenizer = load_tokenizer(build_tiny_tokenizer(corpus(2000, seed=0), root / "tokenizer", vocab_size=512))
    cfg = OmegaConf.structured(ModelConfig)
    with single_process():
        seed_everything(0)
        model = attach_scalar_head(build_gpt(cfg, len(tokenizer)), 1)
        checkpoint.save_checkpoint(root / "rm", model, cfg, len(tokenizer), head="reward", tokenizer=tokenizer,
                                   extra_meta={"scalar_head": {"num_outputs": 1, "attributes": None, "loss": "bt"}})
    return root / "rm"


def timed(fn, seconds: float) -> list[float]:
    """Latencies (s) of back-to-back calls for about `seconds` (at least 5 calls, after 2 warm-ups)."""
    fn(), fn()
    latencies, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(latencies) < 5:
        start = time.perf_counter()
        fn()
        latencies.append(time.perf_counter() - start)
    return latencies


def served_sequential(port: int, inputs: dict, seconds: float) -> list[float]:
    from aligner.servers.client import EndpointClient

    endpoint = EndpointClient("127.0.0.1", port, "reward_model")
    return timed(lambda: endpoint.call(inputs), seconds)


def served_concurrent(port: int, inputs: dict, rows: int, seconds: float, clients: int) -> float:
    """rows/s with `clients` threads sending back to back (the dynamic batcher may merge them)."""
    from aligner.servers.client import EndpointClient

    done, stop = [0] * clients, threading.Event()

    def client(i):
        own = EndpointClient("127.0.0.1", port, "reward_model")
        while not stop.is_set():
            own.call(inputs)
            done[i] += 1

    workers = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    return sum(done) * rows / (time.perf_counter() - start)


def main() -> None:
    from types import SimpleNamespace

    from aligner.models.checkpoint import load_weights
    from aligner.models.heads import last_token_scores
    from aligner.launch.ranks import single_process
    from aligner.models.scoring import build_scalar_model, forward_rows
    from aligner.runtime.seeding import seed_everything
    from aligner.servers.process import ServerProcess, free_port_block

    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per point")
    parser.add_argument("--length", type=int, default=64, help="tokens per row")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients for the batched column")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server rank and in-process")
    parser.add_argument("--queue-delay-us", type=int, default=2000,
                        help="the dynamic batcher's wait for requests to merge (server.max_queue_delay_us)")
    parser.add_argument("--out", default="runs/bench-reward-server")
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(root)
    rng = random.Random(0)
    batches = {b: (np.array([[rng.randrange(10, 512) for _ in range(args.length)] for _ in range(b)], dtype=np.int64),
                   np.full((b, 1), args.length, dtype=np.int64)) for b in BATCHES}
    port = free_port_block()
    server = ServerProcess("reward", [f"checkpoint={ckpt}", f"launcher.threads_per_rank={args.threads}",
                                      f"server.forward_micro_batch_size={max(BATCHES)}",
                                      f"server.max_queue_delay_us={args.queue_delay_us}"], root / "server", port=port)
    torch.set_num_threads(args.threads)
    local, sequential, concurrent = {}, {}, {}
    try:
        server.start().wait_ready(180)
        with single_process():  # the same checkpoint in this process; each batch size measured both ways in turn
            seed_everything(0)
            parallel = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=None)
            model, _, _ = build_scalar_model(ckpt, parallel, 1)
            load_weights(ckpt, model)
            model.eval()
            for b, (tokens, lengths) in batches.items():
                t, n = torch.from_numpy(tokens), torch.from_numpy(lengths[:, 0])
                local[b] = timed(lambda: forward_rows(model, t, n, max(BATCHES), last_token_scores, (1,)), args.seconds)
                inputs = {"tokens": tokens, "sequence_lengths": lengths}
                sequential[b] = served_sequential(port, inputs, args.seconds)
                concurrent[b] = served_concurrent(port, inputs, b, args.seconds, args.clients)
    finally:
        server.stop()
    print(f"tiny reward model, {args.length} tokens/row, {args.threads} torch thread(s), {args.clients} concurrent "
          f"clients, batcher delay {args.queue_delay_us} us; medians\n")
    print("| batch | in-process rows/s | in-process ms | served rows/s (1 client) | served ms/request | "
          f"served rows/s ({args.clients} clients) | overhead ms/request |\n|---|---|---|---|---|---|---|")
    for b in BATCHES:
        mine, theirs = statistics.median(local[b]), statistics.median(sequential[b])
        print(f"| {b} | {b / mine:.0f} | {mine * 1e3:.2f} | {b / theirs:.0f} | {theirs * 1e3:.2f} | "
              f"{concurrent[b]:.0f} | {(theirs - mine) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
