"""The zygote (aligner/launch/zygote.py): a forked child gets what a freshly started `python -m` would (argv,
working directory, environment, signal mask, process group, standard streams) and its exit status comes back as
Popen's; the real preload leaves the zygote single-threaded, so that forking it is safe."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from aligner.launch import zygote
from tests.conftest import REPO


def _start(path: Path, preload: str) -> subprocess.Popen:
    code = f"from aligner.launch.zygote import serve; serve({str(path)!r}, {preload})"
    server = subprocess.Popen([sys.executable, "-c", code, "." * zygote.TITLE_ROOM], cwd=REPO, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not path.is_socket():
        assert server.poll() is None and time.monotonic() < deadline, "the zygote did not come up"
        time.sleep(0.02)
    return server


@pytest.fixture(scope="module")
def light_zygote(tmp_path_factory):
    """A zygote that preloads only json: what is tested here is the fork, not the imports."""
    path = tmp_path_factory.mktemp("zygote") / "socket"
    server = _start(path, "('json',)")
    yield str(path)
    server.terminate()
    server.wait()


@pytest.fixture
def through(light_zygote, monkeypatch):
    monkeypatch.setenv(zygote.ZYGOTE_VARIABLE, light_zygote)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def start(*args, **kwargs) -> subprocess.Popen:
        process = zygote.popen([sys.executable, "-m", "tests.zygote_child", *args], **kwargs)
        assert isinstance(process, zygote.ZygoteProcess)
        return process
    return start


def test_a_child_gets_the_requesters_context_and_its_exit_status_comes_back(through, tmp_path):
    process = through("report", "3", cwd=tmp_path, env={**os.environ, "ZYGOTE_TEST_MARKER": "seen", "PYTHONPATH": str(REPO)},
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = process.communicate(timeout=30)
    seen = json.loads(out)
    assert process.returncode == 3 and err == "to stderr\n"
    assert seen["argv"] == ["report", "3"] and seen["cwd"] == str(tmp_path) and seen["marker"] == "seen"
    ours = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    assert seen["main"] == "__main__" and seen["pgid"] == os.getpgrp() and seen["blocked"] == ours


def test_an_uncaught_exception_exits_1_with_its_traceback(through):
    process = through("raise", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 1 and "RuntimeError: an uncaught error" in err and "Traceback" in err


def test_signals_timeouts_and_a_new_session(through):
    process = through("sleep", stdout=subprocess.PIPE, text=True, start_new_session=True)
    seen = json.loads(process.stdout.readline())
    assert seen["sid"] == process.pid and process.poll() is None
    # ps and psutil show the child's command line, not the zygote's
    assert psutil.Process(process.pid).cmdline() == [sys.executable, "-m", "tests.zygote_child", "sleep"]
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.stdout.close()


def test_a_child_outliving_its_dead_zygote_is_waited_for_then_reported_killed(tmp_path, monkeypatch):
    """A timeout may end the zygote with (or before) its child (the device kit's `timeout` signals its whole group):
    the child's status is lost with the zygote, so its Popen reports it killed once it is gone, not an error."""
    server = _start(tmp_path / "socket", "('json',)")
    monkeypatch.setenv(zygote.ZYGOTE_VARIABLE, str(tmp_path / "socket"))
    process = zygote.popen([sys.executable, "-m", "tests.zygote_child", "sleep"], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    assert json.loads(process.stdout.readline())["argv"] == ["sleep"]
    server.kill()
    server.wait()
    assert process.poll() is None  # the zygote is gone, its child runs on
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.3)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.stdout.close()


def test_the_signal_mask_is_the_requesters(through):
    """The launcher blocks SIGUSR1 before it starts ranks (runtime/preemption.py); a rank must start so."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        process = through("report", stdout=subprocess.PIPE, text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    out, _ = process.communicate(timeout=30)
    ours = {int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])}  # an earlier test may have blocked some
    assert json.loads(out)["blocked"] == sorted(ours | {int(signal.SIGUSR1)})


def test_without_a_live_zygote_popen_is_a_plain_popen(monkeypatch, tmp_path):
    monkeypatch.setenv(zygote.ZYGOTE_VARIABLE, str(tmp_path / "no-socket"))
    process = zygote.popen([sys.executable, "-m", "tests.zygote_child", "report"], cwd=REPO, stdout=subprocess.PIPE)
    assert type(process) is subprocess.Popen and process.communicate(timeout=60)[0] and process.returncode == 0


def test_the_real_preload_leaves_one_thread_and_serves_aligner(tmp_path):
    """A fork copies only the forking thread: a thread started by an import would leave its locks held in every
    child. So after importing everything the zygote must still be single-threaded."""
    server = _start(tmp_path / "socket", "")
    try:
        assert os.listdir(f"/proc/{server.pid}/task") == [str(server.pid)]
        env = {**os.environ, zygote.ZYGOTE_VARIABLE: str(tmp_path / "socket")}
        env.pop("SLURM_JOB_ID", None)
        process = zygote.ZygoteProcess(str(tmp_path / "socket"), [sys.executable, "-m", "aligner.cli", "--help"],
                                       cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        assert "train" in process.communicate(timeout=60)[0] and process.returncode == 0
        # a child that wants all cores gets OpenMP workers before its first line; they must not take the SIGUSR1
        # its CLI shields itself from (default action: the process dies)
        env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}
        process = zygote.ZygoteProcess(str(tmp_path / "socket"), [sys.executable, "-m", "tests.zygote_child",
                                                                  "preempt"], cwd=REPO, env=env,
                                       stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "shielded\n"
        process.send_signal(signal.SIGUSR1)
        assert process.communicate(timeout=60)[0] == "requested\n" and process.returncode == 0
    finally:
        server.terminate()
        server.wait()


def test_a_requester_that_hangs_up_or_sits_in_another_session_leaves_the_zygote_serving(through, light_zygote):
    """A connection closed before its request (what a requester does on finding itself in another session) is
    dropped; a requester in another session gets a plain Popen, since a forked child could not join its group."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hang_up:
        hang_up.connect(light_zygote)
    code = ("import subprocess, sys; from aligner.launch import zygote; "
            "p = zygote.popen([sys.executable, '-m', 'json.tool', '--help'], stdout=subprocess.DEVNULL); "
            "p.wait(); print(type(p).__name__)")
    other = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, zygote.ZYGOTE_VARIABLE: light_zygote}, start_new_session=True)
    assert other.stdout.strip() == "Popen", other.stderr
    process = through("report", "0", stdout=subprocess.PIPE, text=True)
    assert json.loads(process.communicate(timeout=30)[0])["argv"] == ["report", "0"] and process.returncode == 0


# what `aligner` runs first (aligner/cli.py console), then a pause: a stop can be asked before the child exists
RELAY = ("import sys; from aligner.runtime import preemption; from aligner.launch.zygote_relay import run_forked; "
         "preemption.install(); print('relay ready', flush=True); sys.stdin.readline(); "
         "sys.exit(run_forked('tests.zygote_child', sys.argv[1:]))")


def _relay(zygote_path: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, zygote.ZYGOTE_VARIABLE: zygote_path, "PYTHONPATH": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    relay = subprocess.Popen([sys.executable, "-c", RELAY, *args], cwd=REPO, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert relay.stdout.readline() == "relay ready\n"
    return relay


def test_a_relayed_command_runs_in_the_zygotes_child_which_gets_the_relays_signals_and_exit(light_zygote):
    """aligner/launch/zygote_relay.py: the command runs in a child of the zygote, started with SIGUSR1 blocked;
    a stop sent to the relaying process before the child exists, or while it runs, reaches the child; the relay
    exits with the child's status, or by the signal that ended it."""
    report = _relay(light_zygote, "report", "3")
    out, _ = report.communicate("\n", timeout=60)
    seen = json.loads(out)
    assert report.returncode == 3 and seen["ppid"] != report.pid and seen["pgid"] == os.getpgid(0)
    assert int(signal.SIGUSR1) in seen["blocked"]
    for early in (True, False):
        relay = _relay(light_zygote, "preempt")
        if early:
            relay.send_signal(signal.SIGUSR1)
        relay.stdin.write("\n")
        relay.stdin.flush()
        assert relay.stdout.readline() == "shielded\n"
        if not early:
            relay.send_signal(signal.SIGUSR1)
        assert relay.stdout.readline() == "requested\n", early
        assert relay.wait(timeout=30) == 0
        relay.stdout.close()
    sleeper = _relay(light_zygote, "sleep")
    sleeper.stdin.write("\n")
    sleeper.stdin.flush()
    child = json.loads(sleeper.stdout.readline())
    assert psutil.Process(child["ppid"]).cmdline()[:2] == [sys.executable, "-c"]  # the zygote's, not the relay's
    sleeper.send_signal(signal.SIGTERM)
    assert sleeper.wait(timeout=30) == -signal.SIGTERM
    sleeper.stdout.close()
