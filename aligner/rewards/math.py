"""Rule-based rewards for math answers: compare the number a response ends with (or its
`\\boxed{...}` answer) with the reference answer.

Conventions: a number is an optionally signed integer, decimal or fraction (`-3`, `2.50`, `7/4`),
with thousands separators removed (`1,234`); numbers are compared exactly as rationals, so `2.50`
equals `5/2`. A response with no number, or a reference that is not a number, scores 0.
"""
from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def parse_number(text: str) -> Fraction | None:
    """The value of a number as written above, or None."""
    text = text.strip().replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(response: str) -> str | None:
    """The content of the last `\\boxed{...}` when there is one, else the last number of the response."""
    boxed = _BOXED.findall(response)
    if boxed:
        return boxed[-1].strip()
    return last_number(response)


def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 when the last number in `response` equals `answer` (the synthetic arithmetic task's
    reference, `aligner.data.synthetic`), else 0.0."""
    found, expected = last_number(response), parse_number(answer)
    return float(found is not None and expected is not None and parse_number(found) == expected)


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's answer (`extract_answer`) equals the reference: as numbers when both
    parse, else as strings with all whitespace removed."""
    found = extract_answer(response)
    if found is None:
        return 0.0
    a, b = parse_number(found), parse_number(answer)
    if a is not None and b is not None:
        return float(a == b)
    return float("".join(found.split()) == "".join(answer.split()))
