"""Synthetic arithmetic data for examples and tests, deterministic by seed.

A problem is `{"question": "12+7=", "answer": "19"}` with operands in [min_operand, max_operand]; subtraction
puts the larger operand first, so every answer is a non-negative integer. Writers produce the two SFT
formats that `aligner.data.sft` reads (chat and input/output), one JSON object per line, and tool-use
conversations for the `calculator` environment (`aligner.envs.tools`).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_problems(n: int, seed: int, max_operand: int = 99, ops: str = "+-*",
                        min_operand: int = 0) -> list[dict]:
    """`n` problems drawn with `random.Random(seed)`: the same arguments always give the same list."""
    if unknown := set(ops) - set(_APPLY):
        raise ValueError(f"ops may only contain {''.join(_APPLY)}, got {''.join(sorted(unknown))}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"expected 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        op = rng.choice(ops)
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        if op == "-" and a < b:
            a, b = b, a
        problems.append({"question": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))})
    return problems


def chat_messages(problem: dict) -> list[dict]:
    """The user/assistant conversation for one problem: "What is 12+7?" -> "19"."""
    return [{"role": "user", "content": f"What is {problem['question'][:-1]}?"},
            {"role": "assistant", "content": problem["answer"]}]


def calculator_messages(problem: dict) -> list[dict]:
    """The tool-use conversation for one problem, as the `calculator` environment's episodes render it: the
    question, a call ("<calc>12*7</calc>"), its value as a tool turn, and the value as the final answer."""
    return [chat_messages(problem)[0],
            {"role": "assistant", "content": f"<calc>{problem['question'][:-1]}</calc>"},
            {"role": "tool", "content": problem["answer"]},
            {"role": "assistant", "content": problem["answer"]}]


def _write_lines(path: str | Path, records) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def write_sft_chat(path: str | Path, n: int, seed: int, max_operand: int = 99) -> Path:
    """Write `n` chat records `{"messages": [user, assistant]}` to `path`; returns `path`."""
    problems = arithmetic_problems(n, seed, max_operand)
    return _write_lines(path, ({"messages": chat_messages(p)} for p in problems))


def write_calculator_chat(path: str | Path, problems: list[dict], tool_fraction: float = 1.0, seed: int = 0) -> Path:
    """Write one chat record per problem to `path`: its calculator conversation (`calculator_messages`) with
    probability `tool_fraction` (drawn with `random.Random(seed)`), else an answer without the tool, in words ("It
    is 84"); returns `path`."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    rng = random.Random(seed)

    def messages(problem):
        if rng.random() < tool_fraction:
            return calculator_messages(problem)
        return [chat_messages(problem)[0], {"role": "assistant", "content": f"It is {problem['answer']}"}]

    return _write_lines(path, ({"messages": messages(p)} for p in problems))


def write_input_output(path: str | Path, n: int, seed: int, max_operand: int = 99) -> Path:
    """Write `n` records `{"input": "12+7=", "output": "19"}` to `path`; returns `path`."""
    problems = arithmetic_problems(n, seed, max_operand)
    return _write_lines(path, ({"input": p["question"], "output": p["answer"]} for p in problems))


def write_arithmetic_prompts(path: str | Path, n: int, seed: int, max_operand: int = 99, chat: bool = True) -> Path:
    """Write `n` RL prompt records (`write_prompts`) of `arithmetic_problems(n, seed, max_operand)` to `path`."""
    return write_prompts(path, arithmetic_problems(n, seed, max_operand), chat)


def write_prompts(path: str | Path, problems: list[dict], chat: bool = True) -> Path:
    """Write one RL prompt record (`aligner.data.prompts`) per problem to `path`: `{"prompt": [user message],
    "answer": "19"}` with `chat` (the user turn of `chat_messages`), else `{"prompt": "12+7=", "answer": "19"}`;
    returns `path`. The `arithmetic` reward function scores answers to them."""
    return _write_lines(path, ({"prompt": chat_messages(p)[:1] if chat else p["question"], "answer": p["answer"]}
                               for p in problems))


def corpus(n: int, seed: int, max_operand: int = 99) -> list[str]:
    """Texts to train the tiny tokenizer on: `n` problems in both the chat and the input/output wording,
    plus every number 0..max_operand, so numbers, operators and the question text get merged tokens."""
    texts = [str(i) for i in range(max_operand + 1)]
    for p in arithmetic_problems(n, seed, max_operand):
        texts.append(f"What is {p['question'][:-1]}? {p['answer']}")
        texts.append(p["question"] + p["answer"])
    return texts
