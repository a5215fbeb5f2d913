"""The online-RL rewards: the math rules (math-verify, the arithmetic task's exact rule, on any thread),
the builtin rule rewards, resolving names, and RewardScorer (weights, unscored samples never 0, worker
processes equal serial scoring, a dying worker, the stop signal, a reward server)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from aligner.rewards import math as math_rules
from aligner.rewards.functions import (REWARD_FUNCTIONS, arithmetic_answer, call_reward, exact_match, math_answer,
                                       r1_format, regex_match, resolve_reward_functions)
from aligner.rewards.scoring import RewardScorer
from aligner.runtime.ports import free_port
from tests import rl_reward_fixtures as fx
from tests.conftest import REPO

# ---- math ---------------------------------------------------------------------------------------------
MATH_CASES = [
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"so \boxed{0.5}", "1/2", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.333333", 1.0),  # equal to 6 decimals
    (r"\boxed{x+1}", "x + 1", 1.0),  # symbolic; read as plain text the reference would be its last number
    ("First 3, then finally 5", "5", 1.0),  # no box: the last expression
    ("First 3, then finally 5", "3", 0.0),
    (r"\boxed{3} and later 5", "3", 1.0),  # the box wins
    (r"The answer is \boxed{3}", "4", 0.0),
    ("I do not know", "3", 0.0),  # no answer
    ("", "3", 0.0),
]


@pytest.mark.parametrize("response, answer, expected", MATH_CASES)
def test_math_verify_rule(response, answer, expected):
    assert math_rules.math_verdict(response, answer) == expected
    assert math_answer("prompt", response, answer=answer) == expected


def test_math_unparseable_reference_is_unscored_but_the_verifier_scores_it_0():
    assert math_rules.math_verdict(r"\boxed{3}", "") is None
    assert math_rules.math_reward(r"\boxed{3}", "") == 0.0


def test_math_off_the_main_thread_matches_the_main_thread():
    """math-verify's signal timeouts would raise off the main thread; they are disabled there."""
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda case: math_rules.math_verdict(case[0], case[1]), MATH_CASES * 3))
    assert threaded == [expected for _, _, expected in MATH_CASES] * 3


def test_math_times_out_a_pathological_answer_on_the_main_thread(monkeypatch):
    monkeypatch.setattr(math_rules, "MATH_VERIFY_TIMEOUT_S", 1)
    start = time.monotonic()
    assert math_rules.math_verdict(r"\boxed{10^{10^{100}}}", "5") == 0.0  # unbounded without the timeout
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("response, answer, expected", [
    ("19", "19", 1.0), ("12+7=19", "19", 1.0), ("The answer is 19.", "19", 1.0), ("19.0", "19", 1.0),
    ("2.50", "5/2", 1.0), ("1,234", "1234", 1.0), ("-4", "-4", 1.0),
    ("19, no wait, 18", "19", 0.0), ("190", "19", 0.0), ("4", "-4", 0.0), ("no idea", "19", 0.0),
    (r"\boxed{19} then 7", "19", 0.0),  # the last number, whatever the layout
    ("19", "nineteen", None),  # the reference is not a number
])
def test_arithmetic_exact_rule(response, answer, expected):
    assert arithmetic_answer("12+7=", response, answer=answer) == expected


# ---- rule rewards -------------------------------------------------------------------------------------
def test_exact_match():
    assert exact_match("p", " 19\n", answer="19") == 1.0
    assert exact_match("p", "19", answer=19) == 1.0  # a JSON number
    assert exact_match("p", "19.", answer="19") == 0.0
    assert exact_match("p", "Paris", answer="paris") == 0.0


def test_regex_searches_the_response():
    assert regex_match("p", "42 apples", pattern=r"apples") == 1.0
    assert regex_match("p", "42 apples", pattern=r"^\d+$") == 0.0
    assert regex_match("p", "42", pattern=r"^\d+$") == 1.0
    assert regex_match("p", "a\nb", pattern=r"(?s)a.b") == 1.0
    assert call_reward(regex_match, "p", "x", {"pattern": "("})[0] is None  # an invalid pattern: unscored


@pytest.mark.parametrize("response, expected", [
    ("<think>7+12 is 19</think>19", 1.0),
    ("\n <think>\nhmm\n</think>\n\nThe answer is 19.", 1.0),
    ("<think></think>19", 1.0),
    ("<think>hmm</think>   \n", 0.0),  # no answer
    ("19", 0.0),
    ("<think>hmm", 0.0),
    ("Sure. <think>hmm</think>19", 0.0),  # text before the block
    ("<think>a</think>19<think>b</think>", 0.0),
    ("<think><think>a</think>19", 0.0),
    ("<think>a</think>19</think>", 0.0),
])
def test_r1_format(response, expected):
    assert r1_format("p", response) == expected


def test_missing_fields_leave_samples_unscored():
    for fn in (math_answer, arithmetic_answer, exact_match, regex_match):
        assert fn("p", "19") is None
    assert REWARD_FUNCTIONS["format"]("p", "<think>a</think>b") == 1.0  # needs no field
    # prompt and response are positional-only: a record field named "response" does not collide
    assert exact_match("p", "19", answer="19", response="the reference response") == 1.0


def test_call_reward_outcomes():
    assert call_reward(fx.emits_target, "p", "7 7 7", {}) == (1.0, "")
    assert call_reward(fx.unscorable_when, "p", "r", {"unscorable": True}) == (None, "")
    value, why = call_reward(fx.raises_when, "p", "r", {"fail": True})
    assert value is None and why == "raises_when raised RuntimeError: asked to fail"
    value, why = call_reward(fx.nan_when, "p", "r", {"nan": True})
    assert value is None and "returned nan, not a finite number" in why
    assert call_reward(lambda p, r: "1", "p", "r", {})[0] is None
    assert call_reward(lambda p, r: True, "p", "r", {}) == (1.0, "")


# ---- resolving names ----------------------------------------------------------------------------------
def test_resolve_builtins_and_module_functions():
    assert resolve_reward_functions(["math", "format", "tests.rl_reward_fixtures:emits_target"]) == \
        [math_answer, r1_format, fx.emits_target]
    assert resolve_reward_functions([]) == []


@pytest.mark.parametrize("name, expected", [
    ("nope", "unknown reward function 'nope': expected a builtin (math, arithmetic, exact_match, regex, format, code, code_all)"),
    ("tests.rl_reward_fixtures:missing", "'tests.rl_reward_fixtures:missing' cannot be loaded (AttributeError"),
    ("no_such_package.mod:f", "'no_such_package.mod:f' cannot be loaded (ModuleNotFoundError"),
    ("tests.rl_reward_fixtures:os", "'tests.rl_reward_fixtures:os' is a module, not a function"),
])
def test_resolve_errors_name_the_function(name, expected):
    with pytest.raises(ValueError, match=re.escape(expected)) as e:
        resolve_reward_functions(["math", name])
    assert "(math, arithmetic, exact_match, regex, format, code, code_all)" in str(e.value)


def test_resolving_imports_no_torch():
    code = ("import sys; from aligner.rewards.functions import resolve_reward_functions; "
            "resolve_reward_functions(['math', 'regex', 'tests.rl_reward_fixtures:emits_target']); "
            "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- the scorer ---------------------------------------------------------------------------------------
FUNCTIONS = [arithmetic_answer, fx.emits_target, fx.unscorable_when, fx.raises_when, fx.nan_when]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, -1.0]


@pytest.fixture(scope="module")
def scorer():
    s = RewardScorer(FUNCTIONS, WEIGHTS, workers=4)
    yield s
    s.close()


def serial_reward(prompt, response, fields):
    values = [call_reward(fn, prompt, response, fields)[0] for fn in FUNCTIONS]
    return None if None in values else sum(w * v for w, v in zip(WEIGHTS, values))


def test_weights_combine_and_unscored_samples_are_none(scorer):
    samples = [
        ("7 7 7 so 19", {"answer": "19"}),  # 1*1 + 0.5*1 + 2*1 + 1*1 - 1*1 = 3.5
        ("18", {"answer": "19"}),  # 1*0 + 0.5*0 + 2 + 1 - 1 = 2.0
        ("19", {"answer": "19", "unscorable": True}),  # returned None
        ("19", {"answer": "19", "fail": True}),  # raised
        ("19", {"answer": "19", "nan": True}),  # non-finite
        ("19", {}),  # arithmetic needs the answer
        ("7 7 7 is not 19", {"answer": "19", "target": "is not"}),  # 1 + 0.5 + 2 + 1 - 1 = 3.5
    ]
    rewards = scorer.submit(["What is 12+7?"] * len(samples), [r for r, _ in samples],
                            [f for _, f in samples]).result(timeout=120)
    assert rewards == [3.5, 2.0, None, None, None, None, 3.5]


def test_workers_equal_serial_scoring(scorer):
    responses = [f"{i % 5} 7 7 7" if i % 3 else f"answer {i % 7}" for i in range(64)]
    fields = [{"answer": str(i % 5), "unscorable": i % 11 == 0, "fail": i % 13 == 0, "nan": i % 17 == 0}
              for i in range(64)]
    prompts = [f"prompt {i}" for i in range(64)]
    expected = [serial_reward(p, r, f) for p, r, f in zip(prompts, responses, fields)]
    assert None in expected and 0 < len({e for e in expected if e is not None}) and len(expected) == 64
    first = scorer.submit(prompts, responses, fields)
    second = scorer.submit(prompts[::-1], responses[::-1], fields[::-1])  # two batches in flight
    assert first.result(timeout=120) == expected
    assert second.result(timeout=120) == expected[::-1]
    assert scorer.submit([], [], []).result(timeout=60) == []


def test_workers_survive_the_stop_signal(scorer):
    """Slurm's SIGUSR1 reaches every process of the job; the rank stops at a checkpoint, its workers go on."""
    scorer.submit(["p"] * 8, ["7 7 7 1"] * 8, [{"answer": "1"}] * 8).result(timeout=120)  # workers started
    # this scorer's pool workers only: other multiprocessing children of the test process (earlier tests'
    # servers, multiprocessing's resource tracker) are not the scorer's to survive the signal
    workers = [psutil.Process(p.pid) for p in scorer._pool._processes.values()]
    assert len(workers) >= 2
    for p in workers:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)
    assert scorer.submit(["p"] * 8, ["7 7 7 1"] * 8, [{"answer": "1"}] * 8).result(timeout=120) == [3.5] * 8


def test_a_dying_worker_leaves_its_batch_unscored_and_the_next_batch_gets_new_workers():
    scorer = RewardScorer([fx.exits_when], workers=1)
    try:
        assert scorer.submit(["p"] * 3, ["r"] * 3, [{}, {"die": True}, {}]).result(timeout=120) == [None] * 3
        assert scorer.submit(["p"] * 3, ["r"] * 3, [{}] * 3).result(timeout=120) == [1.0] * 3
    finally:
        scorer.close()


def test_scorer_checks_its_arguments():
    with pytest.raises(ValueError, match="cannot be sent to the worker processes"):
        RewardScorer([lambda prompt, response, **fields: 1.0])
    with pytest.raises(ValueError, match="1 weights for 2 reward functions"):
        RewardScorer([fx.emits_target, fx.unscorable_when], [1.0])
    with pytest.raises(ValueError, match="nothing to score with"):
        RewardScorer([])
    with pytest.raises(ValueError, match="must be host:port"):
        RewardScorer([], url="localhost")


def test_no_server_at_the_url_leaves_every_sample_unscored():
    scorer = RewardScorer([], url=f"127.0.0.1:{free_port()}", remote_timeout_s=0.5)
    try:
        rewards = scorer.submit(["p", "p"], [r"\boxed{1}", "2"], [{"answer": "1"}, {"answer": "2"}])
        assert rewards.result(timeout=60) == [None, None]
    finally:
        scorer.close()


@pytest.mark.dist
def test_a_verifier_server_adds_its_reward(tmp_path):
    """A real `aligner serve verifier verifier=math` (about a minute to start on a small CPU host)."""
    pytest.importorskip("pytriton", reason="the servers need the serve extra: pip install 'aligner[serve]'")
    if not __import__("sysconfig").get_config_var("Py_ENABLE_SHARED"):
        pytest.skip("PyTriton's backend needs a Python with a shared libpython")
    from aligner.servers.process import ServerProcess, free_port_block

    server = ServerProcess("verifier", ["verifier=math"], tmp_path / "verifier", port=free_port_block()).start()
    try:
        server.wait_ready(240)
        scorer = RewardScorer([fx.emits_target], [0.5], workers=1, url=f"127.0.0.1:{server.port}",
                              remote_timeout_s=30)
        try:
            rewards = scorer.submit(["p"] * 4, [r"\boxed{\frac{1}{2}} 7 7 7", "3", r"\boxed{2}", "7 7 7"],
                                    [{"answer": "0.5"}, {"answer": "4"}, {"answer": "2"}, {}])
            assert rewards.result(timeout=120) == [1.5, 0.0, 1.0, None]  # no answer for the verifier: unscored
        finally:
            scorer.close()
    finally:
        server.terminate()
        server.stop()
