"""Shared fixtures and helpers (test modules import the helpers as `from tests.conftest import ...`):
the tiny tokenizers and synthetic data, the online-RL assets (an SFT policy and prompt files) and a
local Slurm cluster, each built once per test session; running the `aligner` CLI in a subprocess (each
run gets a clean process, like a user's) and reading its metrics; a tiny model on this one process.
The session starts a zygote (aligner/launch/zygote.py) that has imported torch, megatron-core and aligner
once: CLI runs, their ranks and the servers they start fork from it instead of paying ~5 s of imports each
(Slurm jobs start fresh; ALIGNER_TEST_ZYGOTE=0 turns it off).

README's command runs the suite on two pytest-xdist workers, a test file at a time each (`--dist loadfile`: a
file's module fixtures are built once). With `--unit-lane` (README's command) one worker runs tests/unit, then
the BACKGROUND files once the example is done, at the lowest CPU priority, on the cycles the other worker's tests
leave idle (with a zygote of its own); the other worker runs everything else; without it, both take any file. The
workers share the session's built assets (built once, under a file lock, in the session's shared folder) and the
local Slurm cluster; a test marked `solo` (a timing-sensitive one) runs while no other test does, but for the unit
lane's (at the lowest priority, they take only the cycles it leaves idle); Slurm tests run one at a time."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from filelock import FileLock

from aligner.launch.zygote import ZYGOTE_VARIABLE, popen, run, start as start_zygote

REPO = Path(__file__).resolve().parent.parent
TIERS = ("unit", "integration", "e2e")


# the longest files first, so that no worker starts one of them when the rest of the suite is nearly done
LONGEST_FIRST = ("tests/e2e/test_example.py", "tests/e2e/test_device_kit.py", "tests/e2e/test_ppo.py",
                 "tests/e2e/test_rl_async.py")
# Files that the unit lane runs too, after tests/unit and once the example is done (UnitLane), on the cycles the
# other worker's tests leave idle: CLI runs and in-process checks that assert numbers, not timings, start no
# server and no Slurm job, and whose deadlines a starved minute cannot reach. The other worker takes the last
# of them once its own files are done. Longest first.
BACKGROUND = tuple(f"tests/{name}.py" for name in (
    "e2e/test_rl_loop", "integration/test_generation_engine", "e2e/test_rm", "integration/test_plan_memory",
    "e2e/test_preference", "e2e/test_kd", "e2e/test_errors", "e2e/test_steerlm", "e2e/test_spin",
    "e2e/test_lora_trainers", "integration/test_plan_defaults", "e2e/test_quantized_export", "e2e/test_lora",
    "integration/test_preference_parity", "e2e/test_trackers", "e2e/test_rs", "integration/test_lora",
    "integration/test_parallel_parity", "integration/test_cpu_memory", "integration/test_hf_convert",
    "e2e/test_doctor", "e2e/test_report", "e2e/test_recipes", "integration/test_rl_output_positions",
    "integration/test_megatron_jit", "integration/test_weight_stream_collectives", "integration/test_lora_peft",
    "integration/test_rm_hf", "integration/test_generation_backends", "integration/test_te_spec",
    "integration/test_hf_weights", "integration/test_collectives", "integration/test_kd_parity",
    "integration/test_training_wrap", "e2e/test_plan", "e2e/test_sft", "e2e/test_progress"))
WAIT = "(wait)"  # UnitLane: nothing for this worker yet, but there will be


def pytest_collection_modifyitems(config, items):
    """Each test is marked by its folder's tier, so `-m unit` equals `pytest tests/unit`; the longest files
    first (LONGEST_FIRST). On an xdist worker the `solo` tests go last and are named for the scheduler (SoloLast)."""
    for item in items:
        tier = Path(item.fspath).parent.name
        if tier in TIERS:
            item.add_marker(tier)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.fspath).relative_to(REPO).as_posix(), len(rank)))
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("solo") is not None)
        names = shared_dir() / "solo-tests.txt"  # both workers write the same; read once scheduling starts
        partial = names.with_suffix(f".{os.getpid()}")
        partial.write_text("\n".join(item.nodeid for item in items if item.get_closest_marker("solo")))
        os.replace(partial, names)


UNIT_LANE_WORKER = "gw1"  # with --unit-lane, the worker that runs tests/unit, at the lowest CPU priority


def pytest_addoption(parser):
    parser.addoption("--unit-lane", action="store_true",
                     help="with -n 2 --dist loadfile: one worker runs tests/unit and the BACKGROUND files at the "
                          "lowest CPU priority, on the cycles the other worker's tests leave idle; the other runs "
                          "everything else (module doc)")


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but the solo tests (module doc) are one unit, run last: a solo test waits for the test the
    other worker is running, and at the end that is a short one, not the example's ten minutes. The controller
    does not collect: the workers name the solo tests in the shared folder before they report their collection.
    With --unit-lane, tests/unit is one more unit, which only UNIT_LANE_WORKER runs; then it runs the BACKGROUND
    files, once the example has ended (before, its lowest priority would starve them), and nothing else."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # only where xdist runs the suite

    class SoloLast(LoadFileScheduling):
        solo: set | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.solo is None:
                self.solo = set((shared_dir() / "solo-tests.txt").read_text().splitlines())
            return "solo" if nodeid in self.solo else super()._split_scope(nodeid)

    class UnitLane(SoloLast):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "unit" if scope.startswith("tests/unit/") else scope

        def _busy(self, scope: str) -> bool:
            """`scope` is waiting or has tests still to run."""
            return scope in self.workqueue or any(
                not all(work.get(scope, {}).values()) for work in self.assigned_work.values())

        def _next_scope(self, node) -> str | None:
            """The unit of work `node` takes next (BACKGROUND), WAIT while there is none for it yet, or None."""
            def first(lane):
                return next((scope for scope in lane if scope in self.workqueue), None)
            if node.gateway.id != UNIT_LANE_WORKER:  # its own files, then helps with BACKGROUND's last ones
                alone = all(other.gateway.id != UNIT_LANE_WORKER for other in self.nodes)  # xdist shut it: no work
                return next((scope for scope in self.workqueue
                             if (alone or scope != "unit") and scope not in BACKGROUND), first(BACKGROUND[::-1]))
            if "unit" in self.workqueue:
                return "unit"
            if first(BACKGROUND) is None:
                return None
            return WAIT if self._busy(LONGEST_FIRST[0]) else first(BACKGROUND)

        def _assign_work_unit(self, node) -> None:
            scope = self._next_scope(node)
            if scope is None:
                node.shutdown()
            elif scope != WAIT:
                self.workqueue.move_to_end(scope, last=False)  # the base class takes the queue's first unit
                super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            scope = self._next_scope(node)
            if scope is None:
                node.shutdown()  # it ends once its pending tests have run
            elif scope != WAIT and self._pending_of(self.assigned_work.get(node, {})) <= 2:
                self._assign_work_unit(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # the unit lane may be waiting for the example to end
                if other is not node:
                    self._reschedule(other)

    return (UnitLane if config.getvalue("unit_lane") else SoloLast)(config, log)


class UnitLaneDurations:
    """In the unit lane a test's wall time is mostly waiting for the cycles the other worker leaves: each phase's
    reported duration (--durations, the tier table, UNIT_BUDGET_S) is its CPU time instead, children included.
    Registered only in the lane's worker."""

    def __init__(self):
        self.cpu: dict[str, float] = {}

    @staticmethod
    def _cpu_seconds() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        outcome.get_result().duration = self.cpu.pop(call.when, outcome.get_result().duration)

    def _timed(self, phase: str):
        start = self._cpu_seconds()
        yield
        self.cpu[phase] = self._cpu_seconds() - start

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._timed("setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._timed("call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._timed("teardown")


def _in_unit_lane(config) -> bool:
    worker = getattr(config, "workerinput", {}).get("workerid")
    return bool(config.getoption("unit_lane")) and worker == UNIT_LANE_WORKER


def to_lowest_priority() -> None:
    """This process (and what it starts) runs only on cycles nothing else wants: a session of its own, whose
    autogroup gets the lowest weight (with the kernel's session autogroups, a plain nice value weighs only against
    the processes of the same session), and nice 19."""
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass  # no autogroups: the nice value below is weighed against every process
    os.nice(19 - os.nice(0))


_zygote: subprocess.Popen | None = None
SHARED_VARIABLE = "ALIGNER_TEST_SHARED"  # the session's folder that every xdist worker shares
_owns_shared = False


def pytest_configure(config):
    """The session's shared folder (made by the controller or a plain session; xdist workers inherit it), and
    its zygote; processes start without the zygote until its imports are done (module doc)."""
    global _zygote, _owns_shared
    # (a worker's own "dist" option reads "no": the controller's scheduler, UnitLane, is what gives it its files)
    if _in_unit_lane(config):
        to_lowest_priority()  # this worker will run only tests/unit and BACKGROUND (UnitLane)
        config.pluginmanager.register(UnitLaneDurations(), "unit-lane-durations")
        # its own zygote, below: forked by the session's, its processes would run at that one's priority, and
        # could not join this worker's process groups from another session (aligner/launch/zygote.py)
        os.environ.pop(ZYGOTE_VARIABLE, None)
    if not os.environ.get(SHARED_VARIABLE):
        os.environ[SHARED_VARIABLE] = tempfile.mkdtemp(prefix="aligner-tests-")
        _owns_shared = True
    if os.environ.get("ALIGNER_TEST_ZYGOTE", "1") == "0" or os.environ.get(ZYGOTE_VARIABLE):
        return
    where = Path(tempfile.mkdtemp(prefix="aligner-zygote-"))
    _zygote = start_zygote(where, REPO)
    os.environ[ZYGOTE_VARIABLE] = str(where / "socket")


def pytest_unconfigure(config):
    if _zygote is not None:
        _zygote.terminate()
        _zygote.wait()
    if _owns_shared:  # after every worker is done: the cluster (if a test started it) and the built assets go
        shared = Path(os.environ.pop(SHARED_VARIABLE))
        if (shared / "slurm-started").exists():
            subprocess.run(["bash", "scripts/slurm_local.sh", "stop"], cwd=REPO, capture_output=True, timeout=120)
        shutil.rmtree(shared, ignore_errors=True)


def shared_dir() -> Path:
    return Path(os.environ[SHARED_VARIABLE])


def built_once(name: str, build) -> Path:
    """`build(folder)` once per session, whichever worker asks first; the others wait for it and reuse it."""
    root = shared_dir() / name
    with FileLock(str(root) + ".lock"):
        if not (root / ".built").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            (root / ".built").touch()
    return root


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A `solo` test (its fixtures' set-up included) holds the session's lock alone, every other test holds it
    shared, but for the unit lane's, which run at the lowest priority (`to_lowest_priority`: on cycles a solo
    test leaves idle, which cannot slow it) and take no lock. A test queues at the turnstile first, so that a solo
    test waits only for the tests already running."""
    if _in_unit_lane(item.config) and not item.get_closest_marker("solo"):
        yield
        return
    shared = shared_dir()
    with open(shared / "turnstile.lock", "a") as turnstile, open(shared / "solo.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("solo") else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


UNIT_BUDGET_S = 5.0  # a unit test slower than this belongs in tests/integration (or needs a smaller shape)
_tier_seconds: dict[str, float] = {}
_slow_units: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    """Seconds per tier (setup, call and teardown), and the unit tests over UNIT_BUDGET_S (the first test of a
    session to import torch and megatron pays their import, ~3-6 s: reported, not failed)."""
    tier = Path(report.fspath).parent.name
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration
    if tier == "unit" and report.when == "call" and report.duration > UNIT_BUDGET_S:
        _slow_units.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    """Where the suite's time went, so that it stays fast as tests are added (issue 33 item 5)."""
    if not _tier_seconds:
        return
    terminalreporter.write_sep("-", "seconds per tier")
    for tier, seconds in sorted(_tier_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {tier}")
    for seconds, nodeid in sorted(_slow_units, reverse=True):
        terminalreporter.write_line(f"unit test over {UNIT_BUDGET_S:g} s ({seconds:.1f} s): {nodeid}")


REWARDS = "tests.rl_reward_fixtures"  # reward functions for the RL tests (module:function)


@pytest.fixture(scope="session")
def tiny_assets():
    from aligner.data.synthetic import corpus, write_sft_chat
    from aligner.data.tokenizer import build_tiny_tokenizer

    def build(root):
        build_tiny_tokenizer(corpus(2000, seed=0), root / "tokenizer", vocab_size=512)
        write_sft_chat(root / "train.jsonl", 400, seed=1)
        write_sft_chat(root / "val.jsonl", 64, seed=2)

    return built_once("tiny", build)


def critic_service_processes(run_dir) -> list[psutil.Process]:
    """The processes of the critic service that `aligner train ppo run_dir=RUN_DIR` started (found by the
    `run_dir=RUN_DIR/critic` in their command lines), with their children."""
    marker = f"run_dir={Path(run_dir) / 'critic'}"
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in (p.info["cmdline"] or [])):
            found += [p, *p.children(recursive=True)]
    return found


FRESH = {ZYGOTE_VARIABLE: ""}  # a CLI environment in which processes start fresh, not forked from the zygote


def cli_env(env: dict | None = None) -> dict:
    """The environment of a CLI subprocess: this one, one OpenMP thread, no torchrun rank variables, then `env`."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)
    return full_env


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "aligner.cli", *args], cwd=REPO, env=cli_env(env), timeout=timeout)


def assert_cli_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-4000:]


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`run_cli` without waiting (stdout and stderr piped, text)."""
    return popen([sys.executable, "-m", "aligner.cli", *args], cwd=REPO, env=cli_env(env),
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sigkill_once_logged(process: subprocess.Popen, run_dir, rows: int, timeout: float = 300) -> None:
    """SIGKILL `process` (a `start_cli` run) as soon as `run_dir`'s metrics.jsonl has `rows` rows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (Path(run_dir) / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= rows:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_metrics_match_by_step(metrics: list[dict], reference, keys) -> None:
    """Every record of `metrics` has exactly the `keys` values of the `reference` record of its step
    (`reference`: a list of metrics records, or a dict of them by step)."""
    by_step = reference if isinstance(reference, dict) else {m["step"]: m for m in reference}
    for m in metrics:
        for key in keys:
            assert m[key] == by_step[m["step"]][key], (m["step"], key, m[key], by_step[m["step"]][key])


def write_jsonl_lines(path, lines):
    """Write `lines` to `path`, one per line: strings as they are (malformed lines too), the rest as JSON."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_assets):
    """The tiny example's 512-token BPE tokenizer."""
    from aligner.data.tokenizer import load_tokenizer

    return load_tokenizer(tiny_assets / "tokenizer")


@pytest.fixture(scope="session")
def small_tokenizer_dir():
    """A tiny BPE tokenizer of its own (trained on 300 synthetic texts), for the tokenizer and data tests."""
    from aligner.data.synthetic import corpus
    from aligner.data.tokenizer import build_tiny_tokenizer

    return built_once("tiny_tokenizer", lambda root: build_tiny_tokenizer(corpus(300, seed=0), root))


@pytest.fixture(scope="session")
def small_tokenizer(small_tokenizer_dir):
    from aligner.data.tokenizer import load_tokenizer

    return load_tokenizer(small_tokenizer_dir)


def plain_token_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text` alone (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def init_single_process() -> None:
    """This process as a world of one: a gloo process group and megatron's parallel state (TP=PP=CP=1)."""
    from aligner.runtime import distributed

    distributed.init_process_group()
    distributed.init_model_parallel()


def build_single_process_gpt(seed: int, *, policy: bool = False, vocab_size: int = 300, **model_fields):
    """A GPT of the default (tiny) ModelConfig with `model_fields` set, built on this process as a world
    of one, its weights drawn from `seed`; `policy`: `build_policy` (explicit positions) instead of `build_gpt`."""
    from omegaconf import OmegaConf

    from aligner.config.schema import ModelConfig
    from aligner.models.gpt import build_gpt
    from aligner.models.policy import build_policy
    from aligner.runtime.seeding import seed_everything

    init_single_process()
    seed_everything(seed)
    cfg = OmegaConf.structured(ModelConfig)
    cfg.update(model_fields)
    return (build_policy if policy else build_gpt)(cfg, vocab_size)


@pytest.fixture(scope="session")
def rl_assets(tiny_assets):
    """An arithmetic SFT policy (40 steps) and prompt files: arithmetic prompts, and prompts whose
    record asks for the string "7" (`emits_target`), every third one unscorable (`unscorable_when`)."""
    from aligner.data.synthetic import write_arithmetic_prompts, write_sft_chat

    def build(root):
        write_sft_chat(root / "sft.jsonl", 400, seed=1, max_operand=9)
        write_arithmetic_prompts(root / "prompts.jsonl", 200, seed=3, max_operand=9)
        write_arithmetic_prompts(root / "val.jsonl", 16, seed=4, max_operand=9)
        records = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
        write_jsonl_lines(root / "target.jsonl", [json.dumps({**r, "target": "7", "unscorable": i % 3 == 0})
                                                  for i, r in enumerate(records)])
        result = run_cli("train", "sft", f"run_dir={root / 'sft'}", f"data.train_path={root / 'sft.jsonl'}",
                         f"tokenizer.path={tiny_assets / 'tokenizer'}", "trainer.max_steps=40", "optim.lr=3e-3",
                         "optim.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false")
        assert result.returncode == 0, result.stderr[-3000:]

    return built_once("rl", build)


_slurm_env: dict | None = None  # this worker's environment for the local cluster, once it was started


@pytest.fixture()
def slurm():
    """A local Slurm cluster of 2 fake nodes (scripts/slurm_local.sh); its environment for sbatch & co. One test's
    jobs at a time over all workers, and the start (once per worker) under the same lock: a start finds a cluster
    with another test's job on it not idle and rebuilds it, cancelling the job. Stopped at the session's end
    (pytest_unconfigure)."""
    global _slurm_env
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root (scripts/slurm_local.sh)")
    with FileLock(str(shared_dir() / "slurm.lock")):
        if _slurm_env is None:
            start = subprocess.run(["bash", "scripts/slurm_local.sh", "start"], cwd=REPO, capture_output=True,
                                   text=True, timeout=300)
            (shared_dir() / "slurm-started").touch()
            assert start.returncode == 0, start.stderr
            conf = start.stdout.strip().splitlines()[-1].split("=", 1)[1]
            _slurm_env = {**os.environ, "SLURM_CONF": conf}
        yield _slurm_env


def job_field(env, job: str, field: str) -> str:
    """One field of `scontrol show job -o JOB` ('' when absent)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return next((kv.split("=", 1)[1] for kv in out.split() if kv.startswith(field + "=")), "")


def wait_for_requeued_completion(env, job: str, out, timeout: float) -> str:
    """JOB's output once it completed after exactly one requeue (its script's, after a stop at a checkpoint).
    COMPLETED without a restart (never stopped), FAILED, CANCELLED, TIMEOUT... fail the test.
    A requeued heterogeneous job on this idle local cluster stays PENDING with no reason once its requeue
    delay is over, until some other event runs the scheduler (100-160 s measured; Slurm 22.05's backfill
    reports "no jobs to backfill" meanwhile). Asking it to start now (`scontrol update StartTime=now`) after
    2 s in that state schedules it at once; a busy cluster's own events do the same."""
    deadline = time.monotonic() + timeout
    idle_since = None
    while (state := (job_field(env, job, "JobState"), job_field(env, job, "Restarts"))) != ("COMPLETED", "1"):
        log = out.read_text() if out.exists() else "(no job output yet)"
        assert state[0] in ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "COMPLETING"), f"job {job} {state}:\n{log}"
        assert time.monotonic() < deadline, f"job {job} still {state}:\n{log}"
        if state == ("PENDING", "1") and job_field(env, job, "Reason") == "None":
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 2:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
                idle_since = None
        else:
            idle_since = None
        time.sleep(0.5)
    return out.read_text()


def requeued_job_log(env, job: str, run_dir, out, step: int, stop) -> str:
    """JOB's output once it completed after one requeue: `stop()` (what makes the job stop at a checkpoint) as soon
    as RUN_DIR has `step` metrics rows, the job queued or running meanwhile; the job is cancelled whatever happens."""
    try:
        wait_for_step(run_dir, step, lambda: job_field(env, job, "JobState") in ("PENDING", "CONFIGURING", "RUNNING"))
        stop()
        return wait_for_requeued_completion(env, job, out, timeout=600)
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)


def signal_usr1(env, job: str) -> None:
    """SIGUSR1 to every step of JOB, as Slurm sends it before the time limit."""
    signalled = subprocess.run(["scancel", "--signal=USR1", job], env=env, capture_output=True, text=True)
    assert signalled.returncode == 0, signalled.stderr


def sigusr1_stop_step(log: str) -> int:
    """The step a run said it stopped after on SIGUSR1 (aligner.runtime.preemption.Preempted)."""
    return next(int(line.rsplit("step", 1)[1].split(",")[0]) for line in log.splitlines()
                if "stopped on SIGUSR1 after step" in line)


def wait_for_step(run_dir, step: int, alive, timeout: float = 300) -> None:
    """Until RUN_DIR's metrics.jsonl has `step` lines; `alive()` must hold meanwhile."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert alive(), "the run ended before it could be signalled"
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= step:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir} did not reach step {step} in {timeout} s")
