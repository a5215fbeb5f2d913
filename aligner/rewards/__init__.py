"""Verifiable (rule-based) rewards, by name: `(response, reference answer) -> reward`.
Served by `aligner serve verifier verifier=<name>`."""
from __future__ import annotations

from typing import Callable

from aligner.rewards.math import arithmetic_reward, math_reward

VERIFIERS: dict[str, Callable[[str, str], float]] = {"arithmetic": arithmetic_reward, "math": math_reward}


def get_verifier(name: str) -> Callable[[str, str], float]:
    if name not in VERIFIERS:
        raise KeyError(f"unknown verifier '{name}'; expected one of {', '.join(sorted(VERIFIERS))}")
    return VERIFIERS[name]
