"""Code rewards: run a response's program against a record's tests, in the sandbox (`aligner.rewards.sandbox`,
whose module doc says what it does and does not protect against).

Tests: a list, `{"tests": [...]}`, or either as JSON text; each test is one of
* `{"stdin": "...", "stdout": "..."}` (`stdin` may be left out: empty input): one run of the program per test.
  It passes when the program exits 0 and its stdout equals `stdout` line by line, ignoring the trailing
  whitespace of each line and trailing blank lines.
* `{"assert": "<python expression>"}` (a leading `assert ` is dropped): a record's assert tests run together,
  in one run of the program followed by a harness that evaluates each expression in the program's globals and
  reports it to the host. A true value passes; a false one, or an exception (a MemoryError counts as
  `memory`), fails that test alone; a program that stops before the harness reports (a syntax error, an
  exception at import, sys.exit, reading input that is not there) fails them all.
Programs are Python 3, run as `python -I -S -B main.py` (the standard library only; see the sandbox doc for
which interpreter).

`run_tests(program, tests, language="python", limits=None) -> CodeResult(status, passed, total, detail)`:
`status` is "passed" when every test passed, else the status of the first test (in the record's order) that
did not: "failed" (wrong output, a false or raising assert, or output over the limit), "timeout" (over the
wall or CPU time), "memory" (a MemoryError: over the address-space limit), "crashed" (a nonzero exit, an
uncaught exception, a signal, a sandbox that failed to start), or "refused" (`SandboxRefused`: the host cannot
isolate the program and the user did not opt out; nothing ran, `detail` says how to opt out). After a
stdin/stdout test times out the rest are not run (they count as timeouts): a program that hangs costs one
wall-time limit per record. `run_many` runs many records on a bounded thread pool (each run is a process of
its own; `sandbox.MAX_CONCURRENT` bounds the runs of this process whoever calls).

Rewards, as reward functions (the record's `tests` field; no field: unscored) and as verifiers (`aligner serve
verifier verifier=code`: the `answers` input carries each response's tests as JSON text, e.g.
`{"tests": [{"stdin": "1 2", "stdout": "3"}]}`; tests that do not parse score 0, like the math verifiers'
unparseable references). The program is the response's last ```python (or ```py) fenced block, else its last
fenced block, else the whole response.
* `code` (the default): the fraction of tests passed, partial credit for partly right programs;
* `code_all`: 1.0 only when every test passes (the usual binary pass@1 reward).
As reward functions on `RewardScorer`'s worker processes, each worker runs its samples' programs one after
another (`reward.workers` at once); the verifiers run a server call's rows in parallel. A refused run raises
SandboxRefused's message (the sample is unscored, the verifier's call fails): training on
untrusted code never silently proceeds unisolated.

Reward hacking is not prevented: the assert harness runs inside the program's own process, so a program can
redefine what the expressions call or `print` the harness's report lines (their nonce is in its own source);
stdin/stdout tests are compared on the host and are harder to fool.
"""
from __future__ import annotations

import json
import re
import secrets
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aligner.errors import UserError
from aligner.rewards import sandbox
from aligner.rewards.sandbox import Limits, RunOutput, SandboxRefused

__all__ = ["CodeResult", "Limits", "STATUSES", "SandboxRefused", "code_all_passed", "code_reward", "code_verifier",
           "code_all_verifier", "extract_program", "parse_tests", "run_many", "run_tests"]

STATUSES = ("passed", "failed", "timeout", "memory", "crashed", "refused")
ARGV = ["-I", "-S", "-B", "main.py"]
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_HARNESS = '''

def _aligner_tests(_nonce, _expressions):
    import sys as _sys
    _out = _sys.__stdout__
    for _i, _expression in enumerate(_expressions):
        try:
            _verdict = "pass" if eval(_expression, globals()) else "fail"
        except BaseException as _e:
            _verdict = "fail " + type(_e).__name__
        _out.write(f"\\n{_nonce} {_i} {_verdict}\\n")
        _out.flush()
    _out.write(f"\\n{_nonce} done\\n")
    _out.flush()


'''


@dataclass(frozen=True)
class CodeResult:
    status: str  # one of STATUSES
    passed: int
    total: int
    detail: str = ""  # why the first test that did not pass did not

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    python = [code for tag, code in blocks if tag.lower() in ("python", "python3", "py")]
    return python[-1] if python else blocks[-1][1] if blocks else response


def parse_tests(value) -> list[dict]:
    """The tests of a record's `tests` field or a verifier's answer (see the module doc); raises ValueError."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"the tests are not JSON ({e})") from None
    if isinstance(value, dict) and "tests" in value:
        value = value["tests"]
    if not isinstance(value, list):
        raise ValueError(f"the tests must be a list or {{\"tests\": [...]}}, got {type(value).__name__}")
    tests = []
    for i, test in enumerate(value):
        if isinstance(test, dict) and isinstance(test.get("assert"), str) and len(test) == 1:
            expression = test["assert"].strip()
            tests.append({"assert": expression[len("assert "):] if expression.startswith("assert ") else expression})
        elif isinstance(test, dict) and isinstance(test.get("stdout"), str) and isinstance(test.get("stdin", ""), str) \
                and set(test) <= {"stdin", "stdout"}:
            tests.append({"stdin": test.get("stdin", ""), "stdout": test["stdout"]})
        else:
            raise ValueError(f"test {i + 1} is {str(test)[:200]}; expected {{\"stdin\": str, \"stdout\": str}} or "
                             f"{{\"assert\": \"<python expression>\"}}")
    return tests


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _short(data) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return repr(text[:200] + ("..." if len(text) > 200 else ""))


def _failure(out: RunOutput, limits: Limits) -> tuple[str, str] | None:
    """(status, why) of a run that did not end normally; None when it exited 0."""
    if out.setup_error:
        return "crashed", f"the sandbox failed to start: {out.setup_error}"
    if out.timed_out:
        return "timeout", f"over the wall-time limit of {limits.wall_s:g} s"
    if out.output_overflow:
        return "failed", f"printed more than {limits.output_bytes} bytes"
    if out.exit_code == 0:
        return None
    last = next((line for line in reversed(out.stderr.decode(errors="replace").splitlines()) if line.strip()), "")
    if last.startswith("MemoryError"):
        return "memory", f"MemoryError (address-space limit {limits.memory_mb} MiB)"
    if out.exit_code - 128 in (signal.SIGXCPU, signal.SIGKILL):
        return "timeout", f"over the CPU-time limit of {limits.cpu_s:g} s (killed by signal {out.exit_code - 128})"
    if out.exit_code > 128:
        return "crashed", f"killed by signal {out.exit_code - 128}"
    return "crashed", f"exit code {out.exit_code}: {_short(last)}"


def _run_io(program: str, test: dict, limits: Limits) -> tuple[str, str]:
    out = sandbox.run({"main.py": program}, ARGV, test["stdin"].encode(), limits)
    failure = _failure(out, limits)
    if failure:
        return failure
    got = out.stdout.decode(errors="replace")
    if _lines(got) == _lines(test["stdout"]):
        return "passed", ""
    return "failed", f"expected {_short(test['stdout'])}, got {_short(got)}"


def _run_asserts(program: str, expressions: list[str], limits: Limits) -> list[tuple[str, str]]:
    nonce = secrets.token_hex(8)
    source = f"{program}{_HARNESS}_aligner_tests({nonce!r}, {expressions!r})\n"
    out = sandbox.run({"main.py": source}, ARGV, b"", limits)
    verdicts, done = {}, False
    for line in out.stdout.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == nonce:
            done = done or parts[1] == "done"
            if len(parts) >= 3 and parts[1].isdigit():
                verdicts[int(parts[1])] = parts[2:]
    failure = None if done else _failure(out, limits) or ("crashed", "exited before its tests ran")
    results = []
    for i, expression in enumerate(expressions):
        verdict = verdicts.get(i)
        if verdict is None:
            results.append(failure or ("crashed", "no result"))
        elif verdict == ["pass"]:
            results.append(("passed", ""))
        elif verdict[1:] == ["MemoryError"]:
            results.append(("memory", f"assert {expression} raised MemoryError"))
        else:
            why = f" raised {verdict[1]}" if verdict[1:] else " is false"
            results.append(("failed", f"assert {expression}{why}"))
    return results


def run_tests(program: str, tests: list, language: str = "python", limits: Limits | dict | None = None) -> CodeResult:
    """Run `program` against `tests` in the sandbox (see the module doc). Raises ValueError for no or bad tests."""
    if language != "python":
        raise ValueError(f"language {language!r} is not supported; expected 'python'")
    tests, limits = parse_tests(tests), sandbox.as_limits(limits)
    if not tests:
        raise ValueError("no tests to run")
    try:
        sandbox.isolated(limits)
    except SandboxRefused as e:
        return CodeResult("refused", 0, len(tests), str(e))
    results: list[tuple[str, str] | None] = [None] * len(tests)
    asserts = [i for i, t in enumerate(tests) if "assert" in t]
    if asserts:
        for i, result in zip(asserts, _run_asserts(program, [tests[i]["assert"] for i in asserts], limits)):
            results[i] = result
    hung = False
    for i, test in enumerate(tests):
        if "stdin" in test:
            results[i] = ("timeout", "not run after a timeout") if hung else _run_io(program, test, limits)
            hung = hung or results[i][0] == "timeout"
    passed = sum(status == "passed" for status, _ in results)
    first = next((i for i, (status, _) in enumerate(results) if status != "passed"), None)
    if first is None:
        return CodeResult("passed", passed, len(tests))
    return CodeResult(results[first][0], passed, len(tests), f"test {first + 1}: {results[first][1]}")


def run_many(jobs, limits: Limits | dict | None = None, workers: int | None = None) -> list[CodeResult]:
    """`run_tests` of each `(program, tests)` in `jobs`, `workers` (default: sandbox.MAX_CONCURRENT) at a time."""
    jobs = list(jobs)
    with ThreadPoolExecutor(workers or sandbox.MAX_CONCURRENT, thread_name_prefix="code-sandbox") as pool:
        return list(pool.map(lambda job: run_tests(job[0], job[1], limits=limits), jobs))


def _score(result: CodeResult, all_passed: bool) -> float:
    if result.status == "refused":
        raise UserError(result.detail)
    return float(result.passed == result.total) if all_passed else result.fraction


def code_reward(prompt: str, response: str, /, tests=None, **fields) -> float | None:
    """The `code` reward function: the fraction of the record's `tests` the response's program passes."""
    return None if tests is None else _score(run_tests(extract_program(response), tests), all_passed=False)


def code_all_passed(prompt: str, response: str, /, tests=None, **fields) -> float | None:
    """The `code_all` reward function: 1.0 iff the response's program passes all of the record's `tests`."""
    return None if tests is None else _score(run_tests(extract_program(response), tests), all_passed=True)


def _verifier(name: str, all_passed: bool):
    def verify(response: str, answer: str) -> float:
        try:
            tests = parse_tests(answer)
        except ValueError:
            return 0.0
        return _score(run_tests(extract_program(response), tests), all_passed) if tests else 0.0

    def batch(responses: list[str], answers: list[str]) -> list[float]:
        with ThreadPoolExecutor(sandbox.MAX_CONCURRENT, thread_name_prefix="code-verifier") as pool:
            return list(pool.map(verify, responses, answers))

    verify.__name__ = verify.__qualname__ = name
    verify.batch = batch  # `aligner.rewards.verify_rows` runs a server call's rows in parallel with it
    return verify


code_verifier = _verifier("code_verifier", all_passed=False)
code_all_verifier = _verifier("code_all_verifier", all_passed=True)
