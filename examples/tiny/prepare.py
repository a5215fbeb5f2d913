"""Build the tiny example's inputs with no download: a byte-level BPE tokenizer (vocab 512) and
synthetic arithmetic chat data (train + validation JSONL).

    python examples/tiny/prepare.py --out runs/tiny
"""
from __future__ import annotations

import argparse
from pathlib import Path

from aligner.data.synthetic import corpus, write_sft_chat
from aligner.data.tokenizer import build_tiny_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/tiny")
    parser.add_argument("--train", type=int, default=2000, help="training conversations")
    parser.add_argument("--val", type=int, default=200, help="validation conversations")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(corpus(4000, seed=0), out / "tokenizer", vocab_size=512)
    write_sft_chat(out / "sft_train.jsonl", args.train, seed=1)
    write_sft_chat(out / "sft_val.jsonl", args.val, seed=2)
    print(f"wrote {out}/tokenizer, {out}/sft_train.jsonl, {out}/sft_val.jsonl")


if __name__ == "__main__":
    main()
