"""How the in-process engine should decode with LoRA adapters: merged weights made once per generate call
(what aligner does: `lean_decode.LeanDecoder` reads `lora.merged_weight`), or the adapters applied at every
step (x W^T + s (x A^T) B^T, no merged copy). Measured on one decoder layer's four linears at decode
shapes (one token per sample, batch B), one thread, in the same run:

  merge_ms   making W + s B A for the four linears (once per generate call, per layer)
  step_ms    one decode step's four linears with merged weights / with the adapters applied
  the break-even: decode steps per generate call after which merging is the cheaper choice
  merged copy: the bytes merging holds during the call (the adapted linears' weights), against the weights

    python bench/lora_decode.py [--hidden 128 512 2048] [--batch 64] [--rank 16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _median_ms(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def layer_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    """(out, in) of a Llama-style layer's four linears: 4 query heads per key/value head, ffn = 4 x hidden
    (gated: fc1 is twice that), head dim 64 (32 at hidden 128)."""
    head_dim = 32 if hidden <= 128 else 64
    heads = hidden // head_dim
    groups = max(1, heads // 4)
    ffn = 4 * hidden
    return {"qkv": ((heads + 2 * groups) * head_dim, hidden), "proj": (hidden, heads * head_dim),
            "fc1": (2 * ffn, hidden), "fc2": (hidden, ffn)}


def measure(hidden: int, batch: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = layer_shapes(hidden)
    weights = {k: torch.randn(o, i, generator=g) / i ** 0.5 for k, (o, i) in shapes.items()}
    a = {k: torch.randn(rank, i, generator=g) / i ** 0.5 for k, (o, i) in shapes.items()}
    b = {k: torch.randn(o, rank, generator=g) * 0.01 for k, (o, i) in shapes.items()}
    inputs = {k: torch.randn(batch, i, generator=g) for k, (o, i) in shapes.items()}
    scale = 2.0
    merged = {k: weights[k] + scale * (b[k] @ a[k]) for k in shapes}

    def merge():
        for k in shapes:
            torch.addmm(weights[k], b[k], a[k], alpha=scale)

    def step_merged():
        for k in shapes:
            F.linear(inputs[k], merged[k])

    def step_adapters():
        for k in shapes:
            F.linear(inputs[k], weights[k]).add_(F.linear(F.linear(inputs[k], a[k]), b[k]), alpha=scale)

    merge_ms, merged_ms, adapters_ms = _median_ms(merge, 50), _median_ms(step_merged), _median_ms(step_adapters)
    extra = adapters_ms - merged_ms
    return {"hidden": hidden, "merge_ms": merge_ms, "merged_step_ms": merged_ms, "adapters_step_ms": adapters_ms,
            "break_even_steps": merge_ms / extra if extra > 0 else 0.0,
            "merged_copy_mb": sum(w.numel() for w in merged.values()) * 4 / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"one layer's four linears, batch {args.batch}, rank {args.rank}, fp32, 1 thread "
          f"(torch {torch.__version__}, {torch.get_num_threads()} thread)")
    print(f"{'hidden':>6} {'merge ms':>9} {'step ms merged':>15} {'step ms adapters':>17} {'adapters/merged':>16} "
          f"{'break-even steps':>17} {'merged copy MB':>15}")
    for hidden in args.hidden:
        r = measure(hidden, args.batch, args.rank)
        print(f"{r['hidden']:>6} {r['merge_ms']:>9.3f} {r['merged_step_ms']:>15.3f} {r['adapters_step_ms']:>17.3f} "
              f"{r['adapters_step_ms'] / r['merged_step_ms']:>16.2f} {r['break_even_steps']:>17.1f} "
              f"{r['merged_copy_mb']:>15.2f}")


if __name__ == "__main__":
    main()
