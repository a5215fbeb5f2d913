"""Reward functions of the online-RL loop: the builtins, resolving `reward.functions` names, and calling a
function on one sample.

The contract, one signature for every reward function:
    fn(prompt: str, response: str, **fields) -> float | None
`prompt` is the text the policy saw (`aligner.data.prompts.Prompt.text`), `response` its decoded answer,
`fields` the prompt record's other fields (answer=..., pattern=...). Returning None, raising, or returning
anything but a finite number means "could not be scored": the sample is left out of the update, never
scored 0. A field named `prompt` or `response` collides with the arguments unless the function declares
them positional-only (`fn(prompt, response, /, **fields)`, as the builtins do).

Builtins (a missing field they need leaves the sample unscored):
* `math`: `aligner.rewards.math.math_verdict(response, answer)` (math-verify; 1.0 / 0.0).
* `arithmetic`: the synthetic task's rule, `arithmetic_verdict(response, answer)`: the last number of the
  response equals `answer` as numbers (1.0 / 0.0).
* `exact_match`: 1.0 iff the response equals `answer`, both stripped of surrounding whitespace.
* `regex`: 1.0 iff `re.search(pattern, response)` finds a match anywhere in the response (no flags: put
  `^...$` or inline flags such as `(?s)` in the pattern); an invalid pattern leaves the sample unscored.
* `code` / `code_all`: the response's program run against the record's `tests` in a sandbox
  (`aligner.rewards.code`): the fraction of tests passed / 1.0 iff all pass.
* `format`: DeepSeek-R1's layout without its answer tags: 1.0 iff the response (after leading whitespace)
  is one `<think>...</think>` block followed by a non-blank answer, with no other think tag anywhere.

`resolve_reward_functions` runs at config time in the CLI process; this module imports no torch.
`score_rows` and `worker_init` run in `RewardScorer`'s worker processes.
"""
from __future__ import annotations

import ctypes
import importlib
import math
import numbers
import os
import re
import signal
import sys
from typing import Callable

from aligner.rewards.code import code_all_passed, code_reward
from aligner.rewards.math import arithmetic_verdict, math_verdict
from aligner.runtime.preemption import STOP_SIGNAL

RewardFunction = Callable[..., "float | None"]


def math_answer(prompt: str, response: str, /, answer=None, **fields) -> float | None:
    return None if answer is None else math_verdict(response, str(answer))


def arithmetic_answer(prompt: str, response: str, /, answer=None, **fields) -> float | None:
    return None if answer is None else arithmetic_verdict(response, str(answer))


def exact_match(prompt: str, response: str, /, answer=None, **fields) -> float | None:
    return None if answer is None else float(response.strip() == str(answer).strip())


def regex_match(prompt: str, response: str, /, pattern=None, **fields) -> float | None:
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise TypeError(f"the 'pattern' field must be a string, got {type(pattern).__name__}")
    return float(re.search(pattern, response) is not None)


def r1_format(prompt: str, response: str, /, **fields) -> float:
    thinking, closed, answer = response.lstrip().partition("</think>")
    return float(bool(closed) and thinking.startswith("<think>") and thinking.count("<think>") == 1
                 and "<think>" not in answer and "</think>" not in answer and bool(answer.strip()))


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math": math_answer, "arithmetic": arithmetic_answer, "exact_match": exact_match, "regex": regex_match,
    "format": r1_format, "code": code_reward, "code_all": code_all_passed}


def resolve_reward_functions(names: list[str]) -> list[RewardFunction]:
    """The function of each name: a builtin, or `package.module:function` (imported). Raises ValueError
    naming the name and listing the builtins."""
    builtins = ", ".join(REWARD_FUNCTIONS)
    functions = []
    for name in names:
        if name in REWARD_FUNCTIONS:
            functions.append(REWARD_FUNCTIONS[name])
            continue
        module, colon, attribute = name.partition(":")
        if not (colon and module and attribute):
            raise ValueError(f"unknown reward function {name!r}: expected a builtin ({builtins}) or "
                             f"package.module:function")
        try:
            fn = getattr(importlib.import_module(module), attribute)
        except Exception as e:  # ImportError, AttributeError, or whatever the module raises on import
            raise ValueError(f"reward function {name!r} cannot be loaded ({type(e).__name__}: {e}); expected a "
                             f"builtin ({builtins}) or an importable package.module:function") from e
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a function; expected a "
                             f"builtin ({builtins}) or package.module:function")
        functions.append(fn)
    return functions


def function_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def call_reward(fn: RewardFunction, prompt: str, response: str, fields: dict) -> tuple[float | None, str]:
    """`(reward, "")`, or `(None, why)` when `fn` could not score the sample (why is "" for a None return)."""
    try:
        value = fn(prompt, response, **fields)
    except Exception as e:  # noqa: BLE001 - a reward function's failure leaves its sample unscored
        return None, f"{function_name(fn)} raised {type(e).__name__}: {e}"
    if value is None:
        return None, ""
    if not isinstance(value, numbers.Real) or not math.isfinite(value):  # a bool counts as 1.0 / 0.0
        return None, f"{function_name(fn)} returned {value!r}, not a finite number"
    return float(value), ""


def score_rows(functions: list[RewardFunction], prompts: list[str], responses: list[str],
               fields: list[dict]) -> tuple[list[list[float | None]], list[str]]:
    """Each function's reward of each sample (`[sample][function]`, None where unscored), and the messages
    of the failures (raised or returned a non-number)."""
    rows, problems = [], []
    for prompt, response, record in zip(prompts, responses, fields):
        row = []
        for fn in functions:
            value, why = call_reward(fn, prompt, response, record)
            row.append(value)
            if why:
                problems.append(why)
        rows.append(row)
    return rows, problems


def worker_init() -> None:
    """A worker process ignores the stop signals of its rank: Ctrl-C and SIGUSR1 (which Slurm sends to every
    process of the job; the rank stops at a checkpoint and closes its workers). It starts with SIGUSR1
    blocked (`RewardScorer` spawns it so) until this runs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [STOP_SIGNAL])
    die_with_parent()


def die_with_parent() -> None:
    """On Linux, have the kernel kill this worker when its rank dies, even by SIGKILL (which leaves no
    chance to close the pool): prctl(PR_SET_PDEATHSIG, SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the rank died before the call
        os._exit(1)
