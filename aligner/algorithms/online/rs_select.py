"""Rejection sampling's choice of winners (`aligner train rs`, `aligner rs-generate`): pure, no tensors.

Convention: a prompt's samples are numbered 0..n-1 in generation order (sample k of a step is sample
k % n of prompt k // n). Of each prompt, the `top_n` samples with the highest reward are kept:
* ties go to the lower sample index (so the choice does not depend on anything but the rewards);
* an unscored sample (reward None, or NaN) never wins, whatever its rank;
* a prompt with fewer than `top_n` scored samples keeps only those, and one with none keeps nothing.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def scored(reward) -> bool:
    """A reward that can win: a number that is not NaN."""
    return reward is not None and not (isinstance(reward, float) and math.isnan(reward))


def select_winners(rewards: Sequence[Sequence[float | None]], top_n: int) -> list[list[int]]:
    """rewards [prompts][samples] (None = unscored) -> per prompt, the kept sample indices, best first."""
    if top_n < 1:
        raise ValueError(f"top_n must be >= 1, got {top_n}")
    winners = []
    for group in rewards:
        candidates = [i for i, r in enumerate(group) if scored(r)]
        winners.append(sorted(candidates, key=lambda i: (-group[i], i))[:top_n])
    return winners


def flat_winners(rewards: Sequence[float | None], group_size: int, top_n: int) -> list[int]:
    """`select_winners` of a flat list laid out prompt after prompt (`group_size` samples each): the kept
    samples' flat indices, prompt after prompt, best first within a prompt."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    return [g * group_size + i for g, chosen in enumerate(select_winners(groups, top_n)) for i in chosen]
