"""Rewards.

* Verifiers, by name: `(response, reference answer) -> reward`, served by `aligner serve verifier
  verifier=<name>` (`VERIFIERS`, rules in `math.py`; `code` and `code_all` run programs in a sandbox,
  `code.py`, the answer being the tests as JSON). `verify_rows` scores a call's rows, in parallel when the
  rule has a `batch` function.
* The online-RL loop's reward functions `fn(prompt, response, **fields) -> float | None`: the builtins and
  `resolve_reward_functions` in `functions.py` (no torch: the CLI process resolves names), and
  `scoring.RewardScorer`, which runs them on worker processes, adds a reward server's score and returns a
  future of a batch's rewards. This package imports neither torch nor `scoring`, so the worker processes
  load neither.
"""
from __future__ import annotations

from typing import Callable

from aligner.rewards.code import code_all_verifier, code_verifier
from aligner.rewards.math import arithmetic_reward, math_reward

VERIFIERS: dict[str, Callable[[str, str], float]] = {"arithmetic": arithmetic_reward, "math": math_reward,
                                                     "code": code_verifier, "code_all": code_all_verifier}


def get_verifier(name: str) -> Callable[[str, str], float]:
    if name not in VERIFIERS:
        raise KeyError(f"unknown verifier '{name}'; expected one of {', '.join(sorted(VERIFIERS))}")
    return VERIFIERS[name]


def verify_rows(rule: Callable[[str, str], float], responses: list[str], answers: list[str]) -> list[float]:
    """`rule` on each (response, answer) pair: through `rule.batch` when it has one (the code verifiers run
    their programs in parallel), else one after another."""
    batch = getattr(rule, "batch", None)
    return list(batch(responses, answers)) if batch else [rule(r, a) for r, a in zip(responses, answers)]
