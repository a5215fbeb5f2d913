"""Code rewards in the sandbox (aligner/rewards/code.py, sandbox.py): tests of stdin/stdout and assert kinds,
typed results, the reward functions and verifiers, and hostile programs: each must get a typed result while
the host is unaffected (no process of the run left, nothing written outside its directory, its directory
removed, no host file read that it may not read, no connection reaching the host, the test process's memory
flat). Then 100 concurrent runs, the refusal without namespaces (and the opt-out), and a real `aligner serve
verifier verifier=code` under concurrent requests. Limits are small so that the file stays fast."""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from glob import glob
from pathlib import Path

import psutil
import pytest

from aligner.errors import UserError
from aligner.rewards import VERIFIERS, sandbox, verify_rows
from aligner.rewards.code import (ARGV, CodeResult, Limits, code_all_passed, code_reward, extract_program,
                                  parse_tests, run_many, run_tests)
from aligner.rewards.functions import REWARD_FUNCTIONS
from aligner.rewards.scoring import RemoteReward  # here, not in a test: the host fixture measures the test's growth

# solo: the host fixture checks the whole machine's sandbox processes and run folders, and the timings hold
# a run's wall time to its limit; another worker's sandbox runs would be counted
pytestmark = pytest.mark.solo
LIMITS = Limits(wall_s=2.0, cpu_s=1.5, memory_mb=256, file_mb=1, disk_mb=16, inodes=512, processes=16,
                output_bytes=64 << 10)
ROOT = os.geteuid() == 0
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_TESTS = [{"stdin": "1 2", "stdout": "3"}, {"stdin": "10 -4\n", "stdout": "6\n"}]
MARKER = f"aligner-sandbox-test-{secrets.token_hex(4)}"  # in the command line of processes hostile programs spawn


def leftovers() -> list[str]:
    """Processes a run may have left: of a sandbox uid (as root), a launcher, or one a test program marked."""
    found = []
    for p in psutil.process_iter(["pid", "uids", "cmdline"]):
        uids, command = p.info["uids"], " ".join(p.info["cmdline"] or [])
        if (uids and sandbox.UID_BASE <= uids.real < sandbox.UID_BASE + sandbox.UID_SLOTS) \
                or "sandbox_launch.py" in command or MARKER in command:
            found.append(f"{p.info['pid']} uid {uids.real if uids else '?'}: {command[:120]}")
    return found


def run_dirs() -> set[str]:
    return set(glob(os.path.join(tempfile.gettempdir(), "aligner-sandbox-run-*")))


@pytest.fixture
def host():
    """Checks, after the test, that the host is as it was: no leftover process or directory, memory flat."""
    assert not sandbox.isolation_error(LIMITS), sandbox.isolation_error(LIMITS)
    dirs, rss = run_dirs(), psutil.Process().memory_info().rss
    yield
    time.sleep(0.05)
    assert leftovers() == []
    assert run_dirs() == dirs
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 64 << 20, f"the test process grew by {grown >> 20} MiB"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def timed(program: str, tests, limits=LIMITS) -> tuple[CodeResult, float]:
    start = time.monotonic()
    result = run_tests(program, tests, limits=limits)
    return result, time.monotonic() - start


# ---- tests and results ------------------------------------------------------------------------------------
def test_a_correct_program_passes_and_a_wrong_one_fails(host):
    assert run_tests(ADD, SUM_TESTS, limits=LIMITS) == CodeResult("passed", 2, 2)
    wrong = run_tests(ADD.replace("a + b", "a * b"), SUM_TESTS, limits=LIMITS)
    assert (wrong.status, wrong.passed, wrong.total) == ("failed", 0, 2)
    assert "expected '3', got '2" in wrong.detail
    # trailing whitespace and blank lines do not count; other whitespace does
    assert run_tests("print('1  2 ')\nprint()\n", [{"stdout": "1  2"}], limits=LIMITS).status == "passed"
    assert run_tests("print('1 2')", [{"stdout": "1  2"}], limits=LIMITS).status == "failed"


def test_assert_tests_count_each_expression(host):
    program = "def double(x):\n    return 2 * x\n"
    tests = [{"assert": "double(2) == 4"}, {"assert": "assert double(0) == 0"}, {"assert": "double(3) == 7"},
             {"assert": "double(1) / 0"}, {"assert": "double('a') == 'aa'"}]
    result = run_tests(program, tests, limits=LIMITS)
    assert (result.status, result.passed, result.total) == ("failed", 3, 5)
    assert result.detail == "test 3: assert double(3) == 7 is false"
    assert run_tests(program, tests[:2], limits=LIMITS) == CodeResult("passed", 2, 2)
    mixed = run_tests(ADD + "def f():\n    return 1\n", [{"assert": "f() == 1"}, *SUM_TESTS], limits=LIMITS)
    assert (mixed.status, mixed.passed) == ("crashed", 2)  # the assert run has no input: input() fails first


def test_crashes_are_typed(host):
    for tests in (SUM_TESTS, [{"assert": "True"}]):
        result = run_tests("def broken(:\n    pass\n", tests, limits=LIMITS)
        assert (result.status, result.passed) == ("crashed", 0), result
    assert "SyntaxError" in run_tests("def broken(:\n", SUM_TESTS, limits=LIMITS).detail
    assert run_tests("import sys\nsys.exit(3)", SUM_TESTS, limits=LIMITS).detail.startswith("test 1: exit code 3")
    assert run_tests("import os\nos._exit(0)", [{"assert": "True"}], limits=LIMITS).status == "crashed"
    killed = run_tests("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", SUM_TESTS, limits=LIMITS)
    assert (killed.status, killed.detail) == ("crashed", "test 1: killed by signal 11")


def test_bad_tests_and_languages_are_refused():
    with pytest.raises(ValueError, match="test 1 is"):
        parse_tests([{"stdin": "1"}])
    with pytest.raises(ValueError, match="not JSON"):
        parse_tests("{")
    with pytest.raises(ValueError, match="no tests"):
        run_tests(ADD, [])
    with pytest.raises(ValueError, match="not supported"):
        run_tests(ADD, SUM_TESTS, language="cpp")
    assert parse_tests(json.dumps({"tests": SUM_TESTS}))[0] == {"stdin": "1 2", "stdout": "3"}


def test_reward_functions_and_verifiers(host):
    assert extract_program("Here:\n```python\nprint(1)\n```\nand\n```\nx\n```") == "print(1)\n"
    assert extract_program("```\nprint(2)\n```") == "print(2)\n" and extract_program("print(3)") == "print(3)"
    response = f"The sum:\n```python\n{ADD}```\n"
    half = [SUM_TESTS[0], {"stdin": "2 2", "stdout": "5"}]
    assert REWARD_FUNCTIONS["code"] is code_reward and REWARD_FUNCTIONS["code_all"] is code_all_passed
    assert code_reward("p", response, tests=SUM_TESTS) == 1.0
    assert code_reward("p", response, tests=half) == 0.5 and code_all_passed("p", response, tests=half) == 0.0
    assert code_reward("p", response) is None  # no tests: unscored
    answers = [json.dumps({"tests": SUM_TESTS}), json.dumps(half), "not json", json.dumps({"tests": half})]
    assert verify_rows(VERIFIERS["code"], [response] * 4, answers) == [1.0, 0.5, 0.0, 0.5]
    assert verify_rows(VERIFIERS["code_all"], [response] * 4, answers) == [1.0, 0.0, 0.0, 0.0]


# ---- hostile programs -------------------------------------------------------------------------------------
def test_infinite_loop_times_out(host):
    result, seconds = timed("while True:\n    pass\n", SUM_TESTS)
    assert result.status == "timeout" and result.passed == 0, result
    assert seconds < 2 * LIMITS.wall_s + 2  # the second test is not run after the first timed out
    sleeper, seconds = timed("import time\ntime.sleep(60)", SUM_TESTS)
    assert sleeper.status == "timeout" and "wall-time" in sleeper.detail and seconds < LIMITS.wall_s + 2
    spinner = run_tests("while True:\n    pass\n", SUM_TESTS[:1], limits=replace(LIMITS, cpu_s=1, wall_s=5))
    assert spinner.status == "timeout" and "CPU-time" in spinner.detail, spinner  # SIGXCPU


def test_fork_bomb_stops_at_the_process_limit(host):
    """As root each run has a uid of its own, whose RLIMIT_NPROC holds; not as root the limit is the user's
    task count + `processes` (see sandbox.py)."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    seen, done = [0], threading.Event()

    def count():
        while not done.is_set():
            n = sum(1 for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-4:] == ARGV)
            seen[0] = max(seen[0], n)
            time.sleep(0.02)

    watcher = threading.Thread(target=count)
    watcher.start()
    try:
        result, seconds = timed(bomb, [{"stdout": ""}])
    finally:
        done.set()
        watcher.join()
    assert result.status == "timeout", result
    assert 1 < seen[0] <= LIMITS.processes + (0 if ROOT else 1), seen[0]
    print(f"fork bomb: at most {seen[0]} processes, {seconds:.1f} s")


def test_memory_bombs_get_memory(host):
    for program in ("x = bytearray(1 << 40)", "chunks = []\nwhile True:\n    chunks.append(b'x' * (1 << 20))\n"):
        result = run_tests(program, SUM_TESTS[:1], limits=LIMITS)
        assert result.status == "memory", result
    assert run_tests("def f():\n    return len(bytearray(1 << 40))\n", [{"assert": "f() > 0"}],
                     limits=LIMITS).status == "memory"


def test_huge_files_are_cut_off_and_the_disk_is_bounded(host):
    one = run_tests("open('big', 'wb').write(b'x' * (8 << 20))", SUM_TESTS[:1], limits=LIMITS)
    assert one.status == "crashed" and "File too large" in one.detail, one
    many = run_tests("for i in range(1000):\n    open(f'f{i}', 'wb').write(b'x' * ((1 << 20) - 1))\n",
                     SUM_TESTS[:1], limits=LIMITS)
    assert many.status == "crashed" and "No space left" in many.detail, many


def test_writing_outside_its_directory_reaches_nothing_of_the_host(host, tmp_path):
    targets = [tmp_path / "escaped", Path.cwd() / f"escaped-{MARKER}", Path("/var/tmp") / MARKER,
               Path("/dev/shm") / MARKER, Path(tempfile.gettempdir()) / MARKER, Path.home() / MARKER]
    program = (f"for path in {[str(t) for t in targets]!r}:\n    try:\n        open(path, 'w').write('x')\n"
               f"        print('wrote', path)\n    except OSError as e:\n        print('refused', path, e)\n")
    result = run_tests(program, [{"stdout": "?"}], limits=LIMITS)
    assert result.status == "failed", result  # it ran to the end
    for target in targets:
        assert not target.exists(), target


def test_reading_the_hosts_private_files_fails(host, tmp_path):
    """The host's /tmp is hidden (isolated); as root, files only root may read stay unread."""
    secret = secrets.token_hex(8)
    (tmp_path / "secret").write_text(secret)
    paths, expected = [tmp_path / "secret"], ["refused FileNotFoundError"]
    private = Path.home() / f".{MARKER}"
    if ROOT:
        private.write_text(secret)
        private.chmod(0o600)
        paths, expected = paths + [private, Path("/etc/shadow")], expected + ["refused PermissionError"] * 2
    try:
        program = (f"for path in {[str(p) for p in paths]!r}:\n    try:\n        print(open(path).read())\n"
                   f"    except OSError as e:\n        print('refused', type(e).__name__)\n")
        result = run_tests(program, [{"stdout": "\n".join(expected)}], limits=LIMITS)
        assert result.status == "passed", result
    finally:
        private.unlink(missing_ok=True)


def test_no_connection_reaches_a_loopback_listener(host):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        program = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=1).sendall(b'hi')\n"
                   "    print('connected')\nexcept OSError as e:\n    print('blocked', e.errno)\n" % port)
        result = run_tests(program, [{"stdout": "blocked 101"}], limits=LIMITS)  # ENETUNREACH: lo is down
        assert result.status == "passed", result
        udp = "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('1.1.1.1', 53))\n"
        assert run_tests(udp, [{"stdout": ""}], limits=LIMITS).status == "crashed"
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_children_that_outlive_the_program_are_killed(host):
    program = (f"import os, subprocess, sys\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {MARKER}'], "
               f"start_new_session=True)\n"
               f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)  # {MARKER}'])\n"
               f"    os._exit(0)\n"
               f"print('spawned')\n")
    result, seconds = timed(program, [{"stdout": "spawned"}])
    assert result.status == "passed" and seconds < LIMITS.wall_s, (result, seconds)


def test_ignoring_sigterm_does_not_help(host):
    program = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.1)\n"
    result, seconds = timed(program, SUM_TESTS[:1])
    assert result.status == "timeout" and seconds < LIMITS.wall_s + 2, (result, seconds)


def test_printing_gigabytes_is_cut_at_the_output_limit(host):
    for stream in ("stdout", "stderr"):
        program = f"import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(4096):\n    sys.{stream}.buffer.write(chunk)\n"
        result, seconds = timed(program, SUM_TESTS[:1])
        assert result.status == "failed" and "printed more than" in result.detail, result
        assert seconds < LIMITS.wall_s, seconds


def test_closing_its_own_stdio(host):
    closes = "import os\nfor fd in (0, 1, 2):\n    os.close(fd)\n"
    hangs, seconds = timed(closes + "import time\ntime.sleep(60)\n", SUM_TESTS[:1])
    assert hangs.status == "timeout" and seconds < LIMITS.wall_s + 2, hangs
    assert run_tests(closes, SUM_TESTS[:1], limits=LIMITS).status == "failed"  # exits 0 with no output


def test_100_concurrent_runs(host):
    jobs = [(ADD if i % 3 else ADD.replace("+", "-"), SUM_TESTS[:1]) for i in range(100)]
    start = time.monotonic()
    with ThreadPoolExecutor(100) as pool:  # 100 callers at once; the sandbox runs MAX_CONCURRENT at a time
        direct = list(pool.map(lambda job: run_tests(*job, limits=LIMITS), jobs))
    pooled = run_many(jobs[:20], limits=LIMITS, workers=4)
    print(f"100 concurrent runs: {time.monotonic() - start:.1f} s (with 20 more through run_many)")
    expected = ["passed" if i % 3 else "failed" for i in range(100)]
    assert [r.status for r in direct] == expected
    assert [r.status for r in pooled] == expected[:20]


# ---- no namespaces ----------------------------------------------------------------------------------------
def test_without_namespaces_code_is_refused_unless_the_user_opts_out(host, monkeypatch):
    python = sandbox.interpreter(LIMITS)
    monkeypatch.setitem(sandbox._probed, python, "simulated: unshare: Operation not permitted")
    monkeypatch.delenv(sandbox.OPT_OUT, raising=False)
    refused = run_tests(ADD, SUM_TESTS, limits=LIMITS)
    assert (refused.status, refused.passed, refused.total) == ("refused", 0, 2)
    assert "simulated" in refused.detail and f"{sandbox.OPT_OUT}=1" in refused.detail
    with pytest.raises(UserError, match=sandbox.OPT_OUT):
        code_reward("p", ADD, tests=SUM_TESTS)
    monkeypatch.setenv(sandbox.OPT_OUT, "1")
    assert run_tests(ADD, SUM_TESTS, limits=LIMITS).status == "passed"
    if ROOT:  # unisolated, the sandbox uid still bounds and sweeps what the program leaves
        escape = (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  "
                  f"# {MARKER}'], start_new_session=True)\nopen('/tmp/{MARKER}', 'w').write('x')\nprint('ok')\n")
        assert run_tests(escape, [{"stdout": "ok"}], limits=LIMITS).status == "passed"
        assert not Path("/tmp", MARKER).exists()


# ---- the verifier server ----------------------------------------------------------------------------------
@pytest.mark.dist
def test_verifier_server_code_endpoint_under_concurrent_requests(tmp_path, host):
    pytest.importorskip("pytriton", reason="the servers need the serve extra: pip install 'aligner[serve]'")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        pytest.skip("PyTriton's backend needs a Python with a shared libpython")
    from aligner.servers.client import RewardClient
    from aligner.servers.process import ServerProcess, free_port_block

    server = ServerProcess("verifier", ["verifier=code"], tmp_path / "verifier", port=free_port_block()).start()
    try:
        server.wait_ready(240)
        half = [SUM_TESTS[0], {"stdin": "2 2", "stdout": "5"}]
        cases = [(f"```python\n{ADD}```", json.dumps({"tests": SUM_TESTS}), 1.0), (ADD, json.dumps(half), 0.5),
                 ("print(0)", json.dumps(SUM_TESTS), 0.0), ("def broken(:", json.dumps(SUM_TESTS), 0.0),
                 (ADD, "no tests", 0.0)] * 4
        texts, answers, expected = (list(column) for column in zip(*cases))

        def client_scores(_):
            with RewardClient(port=server.port, model="verifier", max_rows=3, workers=4, timeout_s=120) as client:
                return client.score(texts=texts, answers=answers).result(timeout=180)

        start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:  # 3 clients x 7 requests of up to 3 rows each, at once
            results = list(pool.map(client_scores, range(3)))
        print(f"verifier server: 3 x {len(cases)} programs in {time.monotonic() - start:.1f} s")
        for scores in results:
            assert scores.scored.all(), scores.failures
            assert scores.values[:, 0].tolist() == expected
        # the RL loop's reward.url path: records carry `tests` (as a code prompt file does), not `answer`
        remote = RemoteReward(f"127.0.0.1:{server.port}", timeout_s=60)
        try:
            records = [{"tests": SUM_TESTS}, {"tests": half}, {"tests": json.dumps(SUM_TESTS)}, {"answer": None}]
            responses = [ADD, ADD, "print(0)", ADD]
            assert remote.rewards(["p"] * 4, responses, records) == [1.0, 0.5, 0.0, None]
            assert [code_reward("p", r, **f) for r, f in zip(responses[:2], records)] == [1.0, 0.5]
        finally:
            remote.close()
    finally:
        server.terminate()
        server.stop()
