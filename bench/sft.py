"""SFT throughput on the built-in tiny example: TP=1 (1 rank) against TP=2 (2 ranks), same data,
same global batch, in one run. Prints median step time and tokens/s over steps 6..N, and the ratio.

    python bench/sft.py [--steps 40] [--out runs/bench-sft]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

LAYOUTS = {"TP=1": [], "TP=2": ["launcher.nproc_per_node=2", "model.tensor_model_parallel_size=2"]}


def run(name: str, extra: list[str], root: Path, steps: int) -> dict:
    run_dir = root / name.replace("=", "")
    subprocess.run([sys.executable, "-m", "aligner.cli", "train", "sft", f"run_dir={run_dir}",
                    f"data.train_path={root / 'sft_train.jsonl'}", f"tokenizer.path={root / 'tokenizer'}",
                    f"trainer.max_steps={steps}", "trainer.global_batch_size=32", "trainer.micro_batch_size=8",
                    "trainer.save_last=false", "logging.progress=false", "logging.tensorboard=false", *extra],
                   check=True, capture_output=True, text=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][5:]
    return {"step_s": statistics.median(m["timing/step_s"] for m in metrics),
            "tokens_per_s": statistics.median(m["throughput/tokens_per_s"] for m in metrics)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/bench-sft")
    args = parser.parse_args()
    root = Path(args.out)
    subprocess.run([sys.executable, "examples/tiny/prepare.py", "--out", str(root)], check=True, capture_output=True)
    results = {name: run(name, extra, root, args.steps) for name, extra in LAYOUTS.items()}
    base = results["TP=1"]["tokens_per_s"]
    print("| layout | median s/step | tokens/s | vs TP=1 |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
