"""The reward of the TRL peer baseline's arithmetic task (its common.py `arith_reward`) as an aligner
reward function, for bench/rl_vs_trl.py: `reward.functions=[bench.rl_reward:arith]`.

The rule, unchanged: 1.0 when the response, stripped of surrounding whitespace, starts with exactly
the integer answer (its leading run of digits equals `answer`: "19<eos>" and " 19" score for "19",
"18", "190" and "x19" do not), else 0.0. A prompt record without an answer cannot be scored (None).
"""
from __future__ import annotations


def arith(prompt: str, response: str, /, answer: str | None = None, **fields) -> float | None:
    if answer is None:
        return None
    digits = ""
    for ch in response.strip():  # the baseline's loop as it is (str.isdigit, not only ASCII digits)
        if not ch.isdigit():
            break
        digits += ch
    return 1.0 if digits == str(answer) else 0.0
