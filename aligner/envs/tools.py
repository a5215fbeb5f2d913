"""The built-in environments: `calculator` (a toy tool for tests and the example) and `python` (the code
sandbox as a tool). In both, an assistant turn that calls no tool is the final answer: it ends the episode
and is scored by the run's reward functions on the record (`Environment.score`)."""
from __future__ import annotations

import ast
import operator
import re

from aligner.envs.base import Environment, Observation
from aligner.rewards import sandbox

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # `2 ** 10 ** 9` would hang the worker: larger exponents are refused


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses), or `error: why`."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"{ast.dump(node)[:60]} is not arithmetic")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError) as e:
        return f"error: {type(e).__name__}: {e}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


def calculator_call(prompt: str, response: str, /, answer=None, **fields) -> float | None:
    """A reward function (`reward.val_functions=[aligner.envs.tools:calculator_call]`) for calculator episodes:
    1.0 when the first `<calc>` call in the episode's text (its turns and observations) evaluates to `answer`,
    0.0 when it does not or there is none; None without an answer."""
    if answer is None:
        return None
    call = _CALL.search(response)
    value = calculate(call.group(1)) if call is not None else "error"
    return float(not value.startswith("error") and value == calculate(str(answer)))


class Calculator(Environment):
    """A turn with `<calc>EXPRESSION</calc>` gets the value of its first expression back as a tool turn;
    any other turn is the final answer."""

    def reset(self, record: dict) -> Observation | None:
        self.record = record
        return None

    def step(self, action: str):
        call = _CALL.search(action)
        if call is None:
            return None, self.score(action), True
        return calculate(call.group(1)), None, False


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.S | re.I)


class PythonTool(Environment):
    """A turn with a fenced python block runs its last block in the code sandbox (`aligner.rewards.sandbox`,
    with its limits: `limits`, default 5 s wall time); stdout, then stderr, each cut to `max_output_chars`,
    come back as a tool turn. A turn without a block is the final answer."""

    ARGV = ["-I", "-S", "-B", "main.py"]

    def __init__(self, rewards=(), weights=None, limits: dict | None = None, max_output_chars: int = 512):
        super().__init__(rewards, weights)
        self.limits = sandbox.as_limits({"wall_s": 5.0, "cpu_s": 5.0, **(limits or {})})
        self.max_output_chars = max_output_chars
        sandbox.isolated(self.limits)  # SandboxRefused here, at construction: a run that cannot isolate stops

    def reset(self, record: dict) -> Observation | None:
        self.record = record
        return None

    def step(self, action: str):
        blocks = _FENCE.findall(action)
        if not blocks:
            return None, self.score(action), True
        out = sandbox.run({"main.py": blocks[-1]}, self.ARGV, b"", self.limits)
        parts = [self._cut(out.stdout.decode(errors="replace"))]
        if out.stderr:
            parts.append("stderr: " + self._cut(out.stderr.decode(errors="replace")))
        if out.timed_out:
            parts.append(f"timed out after {self.limits.wall_s:g} s")
        elif out.output_overflow:
            parts.append("output over the limit")
        return "\n".join(p for p in parts if p), None, False

    def _cut(self, text: str) -> str:
        n = self.max_output_chars
        return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more characters]"
