"""Rewards.

* Verifiers, by name: `(response, reference answer) -> reward`, served by `aligner serve verifier
  verifier=<name>` (`VERIFIERS`, rules in `math.py`).
* The online-RL loop's reward functions `fn(prompt, response, **fields) -> float | None`: the builtins and
  `resolve_reward_functions` in `functions.py` (no torch: the CLI process resolves names), and
  `scoring.RewardScorer`, which runs them on worker processes, adds a reward server's score and returns a
  future of a batch's rewards. This package imports neither torch nor `scoring`, so the worker processes
  load neither.
"""
from __future__ import annotations

from typing import Callable

from aligner.rewards.math import arithmetic_reward, math_reward

VERIFIERS: dict[str, Callable[[str, str], float]] = {"arithmetic": arithmetic_reward, "math": math_reward}


def get_verifier(name: str) -> Callable[[str, str], float]:
    if name not in VERIFIERS:
        raise KeyError(f"unknown verifier '{name}'; expected one of {', '.join(sorted(VERIFIERS))}")
    return VERIFIERS[name]
