"""Build the tiny example's inputs with no download: a byte-level BPE tokenizer (vocab 512),
synthetic arithmetic chat data for SFT, preference pairs (right answer vs a near miss) for the reward
model and DPO, arithmetic prompts with their answers for GRPO, and the held-out prompts again, rendered with the chat template, for generation.
For examples/tiny/agent.sh: two-digit products (beyond the SFT model) as calculator conversations, a mix in which
most are answered directly, and prompts for GRPO with the calculator tool (agent_*.jsonl).

    python examples/tiny/prepare.py --out runs/tiny
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from aligner.data.preference_rm import write_arithmetic_preferences
from aligner.data.synthetic import (arithmetic_problems, chat_messages, corpus, write_arithmetic_prompts,
                                    write_calculator_chat, write_prompts, write_sft_chat)
from aligner.data.tokenizer import build_tiny_tokenizer, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/tiny")
    parser.add_argument("--train", type=int, default=2000, help="training conversations")
    parser.add_argument("--val", type=int, default=200, help="validation conversations")
    parser.add_argument("--pairs", type=int, default=8000, help="preference pairs (right answer vs a near miss)")
    parser.add_argument("--max-operand", type=int, default=9, help="largest operand (small enough to learn in minutes)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(corpus(4000, seed=0), out / "tokenizer", vocab_size=512)
    write_sft_chat(out / "sft_train.jsonl", args.train, seed=1, max_operand=args.max_operand)
    write_sft_chat(out / "sft_val.jsonl", args.val, seed=2, max_operand=args.max_operand)
    # near misses (off by 1..3) as swapped twins: the reward model must read the question to rank answers
    for name, n, seed in (("pref_train", args.pairs, 3), ("pref_val", args.val, 4)):
        write_arithmetic_preferences(out / f"{name}.jsonl", n, seed=seed, max_operand=args.max_operand, ops="+-*",
                                     max_miss=3)
    write_arithmetic_prompts(out / "rl_train.jsonl", args.train, seed=6, max_operand=args.max_operand)
    # 256 held-out prompts: the accuracy's standard error is about 0.03 (0.06 with 64)
    write_arithmetic_prompts(out / "rl_val.jsonl", 256, seed=7, max_operand=args.max_operand)
    tokenizer = load_tokenizer(out / "tokenizer")
    with open(out / "prompts.jsonl", "w") as f:  # rl_val's problems, rendered for `aligner generate`
        for problem in arithmetic_problems(256, seed=7, max_operand=args.max_operand):
            user_turn = chat_messages(problem)[:1]
            text = tokenizer.apply_chat_template(user_turn, tokenize=False, add_generation_prompt=True)
            f.write(json.dumps({"prompt": text, "answer": problem["answer"]}) + "\n")
    # agent.sh: products of two-digit numbers, which the SFT model (operands up to 9) cannot work out itself. The
    # calculator's demonstrations, then a mix in which one in five uses it (the others answer directly); the 128
    # held-out prompts appear in none of the others
    hard = {"max_operand": 99, "ops": "*", "min_operand": 10}
    val = arithmetic_problems(128, seed=10, **hard)
    unseen = lambda n, seed: [p for p in arithmetic_problems(n, seed, **hard) if p not in val]  # noqa: E731
    write_prompts(out / "agent_val.jsonl", val)
    write_prompts(out / "agent_train.jsonl", unseen(2000, seed=9))
    write_calculator_chat(out / "agent_sft.jsonl", unseen(4000, seed=8))
    write_calculator_chat(out / "agent_mix.jsonl", unseen(2000, seed=12), tool_fraction=0.2, seed=13)
    print(f"wrote {out}/: tokenizer, sft_{{train,val}}.jsonl, pref_{{train,val}}.jsonl, rl_{{train,val}}.jsonl, "
          f"prompts.jsonl, agent_{{sft,mix,train,val}}.jsonl")


if __name__ == "__main__":
    main()
