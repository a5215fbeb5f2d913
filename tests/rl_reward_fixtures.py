"""Reward functions for the tests, loaded by name as `tests.rl_reward_fixtures:<function>` (in
`RewardScorer`'s worker processes too, so they live at the top level of this module)."""
from __future__ import annotations

import os


def emits_target(prompt: str, response: str, /, target: str = "7 7 7", **fields) -> float:
    """1.0 when the response contains the record's `target` (default "7 7 7"), else 0.0."""
    return 1.0 if target in response else 0.0


def unscorable_when(prompt: str, response: str, /, unscorable: bool = False, **fields) -> float | None:
    """None (could not score) when the record's `unscorable` is true, else 1.0."""
    return None if unscorable else 1.0


def raises_when(prompt: str, response: str, /, fail: bool = False, **fields) -> float:
    """Raises RuntimeError when the record's `fail` is true, else 1.0."""
    if fail:
        raise RuntimeError("asked to fail")
    return 1.0


def nan_when(prompt: str, response: str, /, nan: bool = False, **fields) -> float:
    """NaN when the record's `nan` is true, else 1.0."""
    return float("nan") if nan else 1.0


def exits_when(prompt: str, response: str, /, die: bool = False, **fields) -> float:
    """Kills the process calling it (a worker crashing) when the record's `die` is true, else 1.0."""
    if die:
        os._exit(3)
    return 1.0


def response_length(prompt: str, response: str, /, **fields) -> float:
    """The response's length in characters: rewards that differ within a group from the first step."""
    return float(len(response))
