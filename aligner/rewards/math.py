"""Rule-based rewards for math answers: `(response, reference answer)`.

* `arithmetic` (the synthetic task's definition, `aligner.data.synthetic`): 1.0 iff the last number in the
  response equals the reference exactly, as numbers. A number is an optionally signed integer, decimal or
  fraction (`-3`, `2.50`, `7/4`) with thousands separators removed (`1,234`); numbers compare as
  rationals, so `2.50` equals `5/2`.
* `math`: Hugging Face's math-verify (the checker of TRL and open-r1) extracts the response's final answer
  (the last `\\boxed{...}` first, else the last LaTeX or plain expression) and compares it with the parsed
  reference symbolically and numerically (to 6 decimals: `\\frac{1}{3}` equals 0.333333). The reference is
  read as LaTeX: as it is when it has `$` delimiters or a `\\boxed{...}` (a worked solution), else as
  `$answer$` (read as plain text, `x + 1` would be its last number, 1).
The `*_verdict` functions return None when the reference itself is not an answer (not a number, not
parseable): nothing to compare against. The verifier rules (`*_reward`) score that 0.

Threads: math-verify bounds its parsing and comparing with `signal.alarm`, which works only in a process's
main thread (elsewhere it raises ValueError). So the timeouts (`parse(parsing_timeout=...)`,
`verify(timeout_seconds=...)`, MATH_VERIFY_TIMEOUT_S) are set on the main thread only and disabled (None)
on any other: there, a pathological answer can run unbounded (comparing `\\boxed{10^{10^{100}}}` with 5
does not finish), which is why `RewardScorer` calls reward functions on its worker processes' main threads.
"""
from __future__ import annotations

import re
import threading
from fractions import Fraction

from math_verify import parse, verify

MATH_VERIFY_TIMEOUT_S = 5  # per parse and per comparison, main thread only (see the module doc)

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


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


def arithmetic_verdict(response: str, answer: str) -> float | None:
    """1.0 when the last number in `response` equals `answer`, else 0.0; None when `answer` is not a number."""
    expected = parse_number(answer)
    if expected is None:
        return None
    found = last_number(response)
    return float(found is not None and parse_number(found) == expected)


def _timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_verdict(response: str, answer: str) -> float | None:
    """1.0 when math-verify finds the response's final answer equal to `answer`, else 0.0; None when
    `answer` does not parse. Safe on any thread (see the module doc)."""
    timeout = _timeout()
    latex = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    gold = parse(latex, parsing_timeout=timeout)
    if not gold:
        return None
    return float(verify(gold, parse(response, parsing_timeout=timeout), timeout_seconds=timeout))


def arithmetic_reward(response: str, answer: str) -> float:
    """The `arithmetic` verifier: `arithmetic_verdict`, 0.0 when the reference is not a number."""
    verdict = arithmetic_verdict(response, answer)
    return 0.0 if verdict is None else verdict


def math_reward(response: str, answer: str) -> float:
    """The `math` verifier: `math_verdict`, 0.0 when the reference does not parse."""
    verdict = math_verdict(response, answer)
    return 0.0 if verdict is None else verdict
