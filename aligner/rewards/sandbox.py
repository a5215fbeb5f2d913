"""A sandbox for untrusted programs (the `code` reward's), built from what Linux offers without extra packages.

`run(files, argv, stdin, limits)` writes `files` to a private temporary directory (removed afterwards), runs
`<interpreter> argv` on them through `sandbox_launch.py` (the steps, in order) and returns the exit code and
the capped output. What a run gets, in every mode:
* limits (`Limits`): CPU time (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later), wall time (at the deadline
  the host SIGKILLs the run's whole process group: ignoring SIGTERM does not help), address space
  (RLIMIT_AS), the size of any one file (RLIMIT_FSIZE), processes and threads (RLIMIT_NPROC, see below), open
  files, no core dumps; stdout and stderr are read up to `output_bytes` each, then the run is killed
  (printing gigabytes costs the host one capped buffer);
* a new session, a minimal environment (PATH, LANG, HOME), no_new_privs (setuid binaries give nothing),
  default signal actions, and `python -I -S -B`: no site-packages, no PYTHON* variables, the standard
  library only.
Isolated mode (namespaces; the default, and required unless the user opts out):
* network: a namespace of its own whose only interface, loopback, is down: no connection to anything, the
  host's loopback included (abstract Unix sockets are per namespace too);
* processes: a PID namespace: it sees (a fresh /proc) and signals only its own processes; the program runs
  under the namespace's init, and when the program exits, or the launcher dies (parent-death SIGKILL), init
  exits and the kernel kills every process left (daemons, setsid escapes);
* files: a mount namespace where the host's filesystem is read-only and nosuid; /tmp, /dev/shm and /var/tmp
  are one private tmpfs of `disk_mb` and `inodes` files that holds the working directory and vanishes with
  the run; /run is an empty read-only tmpfs. IPC and UTS namespaces of its own.
* as root, each run also gets an unprivileged uid of its own: UID_BASE + a slot that one run at a time
  holds on this host (flock in the temp directory), so RLIMIT_NPROC (counted per real uid, never enforced for
  root) bounds this run alone (a fork bomb stops at `processes`), the program reads only world-readable
  files and signals no one else's processes, and every process of that uid is killed after the run (the
  sweep, a second net under the PID namespace). A uid in UID_BASE..+UID_SLOTS must belong to nothing else
  (ALIGNER_SANDBOX_UID_BASE moves the range). The interpreter must then be runnable by any user:
  `Limits.python`, else $ALIGNER_SANDBOX_PYTHON, else this interpreter when world-executable, else
  /usr/bin/python3 (so possibly another Python version than the host's).
* not root, a user namespace (mapping the user to itself) makes the same namespaces, and the program runs
  as the user: it reads whatever the user can (ssh keys included, though with no network and its output read
  only by the reward it can only put them into its reward or a log line), and RLIMIT_NPROC is the user's task
  count at the start + `processes`, a bound that the user's other processes loosen or tighten.
Namespaces are unavailable in a container without CAP_SYS_ADMIN, where unprivileged user namespaces are
disabled, and on kernels before 5.12 (mount_setattr). An empty program is run once per process to find out;
then `run` raises SandboxRefused, unless the user opts out (ALIGNER_SANDBOX_ALLOW_UNISOLATED=1 or
`Limits(allow_unisolated=True)`). Unisolated, only the limits, the session and, as root, the uid and its sweep
remain: the program can use the network, see the host's processes, write wherever its uid may (the sweep
removes its uid's top-level entries in /tmp, /var/tmp and /dev/shm), and, not as root, signal the user's
processes and leave processes behind outside its process group.

NOT protected against, in any mode: kernel exploits and anything else done through system calls (no seccomp
filter: the kernel is shared); CPU side channels (Spectre-like) and timing; reading world-readable host files
(/etc, the interpreter, the repository) and kernel information in /sys and /proc/sys; using the host's CPU
and memory within its limits (no cgroup: address space is not resident memory, tmpfs pages are host memory,
and the runs at once are bounded by MAX_CONCURRENT per process only); an OOM kill or a SIGKILL past the CPU
limit reads as a timeout. A program can also fool its own assert tests (`aligner.rewards.code`).
"""
from __future__ import annotations

import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from aligner.errors import UserError
from aligner.rewards import sandbox_launch

UID_BASE = int(os.environ.get("ALIGNER_SANDBOX_UID_BASE", 2_100_000_000))  # + slot: the sandbox uids, as root
UID_SLOTS = 1024  # runs at once on this host (every process together), as root
MAX_CONCURRENT = max(4, 2 * (os.cpu_count() or 1))  # runs at once in this process; more callers wait
OPT_OUT = "ALIGNER_SANDBOX_ALLOW_UNISOLATED"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": sandbox_launch.WORKDIR}
_LOCK_DIR = Path(tempfile.gettempdir()) / "aligner-sandbox-uids"


@dataclass(frozen=True)
class Limits:
    """Per run (a program on one input). Sizes in MiB, except `output_bytes` (per stream)."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512  # address space, not resident memory: the interpreter itself takes ~30
    file_mb: int = 16  # largest file the program may write
    disk_mb: int = 64  # its tmpfs (/tmp, the working directory), isolated mode
    inodes: int = 4096
    processes: int = 32  # processes and threads of the sandbox uid
    open_files: int = 256
    output_bytes: int = 1 << 20
    python: str | None = None  # the interpreter; see the module doc
    allow_unisolated: bool = False  # run without namespaces where they are unavailable (see the module doc)


class SandboxRefused(UserError):
    """Untrusted code was not run: the host cannot isolate it and the user did not opt out."""

    fix = (f"run as root, or where unprivileged user namespaces are allowed (sysctl "
           f"kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0); as root, the "
           f"interpreter must be one any user can run (ALIGNER_SANDBOX_PYTHON); or accept running untrusted code "
           f"without network, PID and mount isolation with {OPT_OUT}=1 (what remains: aligner/rewards/sandbox.py)")


@dataclass(frozen=True)
class RunOutput:
    exit_code: int | None  # None when killed by the host (timeout, output limit); 128 + signal when killed
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    output_overflow: bool = False
    setup_error: str = ""  # the launcher could not set the sandbox up
    wall_s: float = 0.0


def as_limits(limits) -> Limits:
    if limits is None:
        return Limits()
    return limits if isinstance(limits, Limits) else Limits(**dict(limits))


def _runnable_by_others(path: str) -> bool:
    path = os.path.realpath(path)
    if not os.path.isfile(path) or not os.stat(path).st_mode & 0o001:
        return False
    while path != "/":
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


def interpreter(limits: Limits) -> str:
    chosen = limits.python or os.environ.get("ALIGNER_SANDBOX_PYTHON")
    if chosen or os.geteuid() != 0:
        return chosen or sys.executable
    return next((p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3") if _runnable_by_others(p)),
                sys.executable)


_probe_lock, _probed = threading.Lock(), {}


def isolation_error(limits: Limits) -> str:
    """Why this host cannot run isolated programs ("" when it can), found once per interpreter."""
    python = interpreter(limits)
    with _probe_lock:
        if python not in _probed:
            out = _run({"main.py": "pass\n"}, ["-I", "-S", "-B", "main.py"], b"",
                       replace(Limits(), python=python), isolate=True)
            _probed[python] = out.setup_error or ("" if out.exit_code == 0 else
                                                  f"an empty program exited with {out.exit_code} in the sandbox: "
                                                  f"{out.stderr.decode(errors='replace').strip()[-500:]}")
    return _probed[python]


def isolated(limits: Limits) -> bool:
    """Whether runs are isolated; raises SandboxRefused where they cannot be and the user did not opt out."""
    why = isolation_error(limits)
    if not why:
        return True
    if limits.allow_unisolated or os.environ.get(OPT_OUT, "") not in ("", "0"):
        return False
    raise SandboxRefused(f"cannot isolate untrusted code on this host ({why})")


_concurrency = threading.BoundedSemaphore(MAX_CONCURRENT)


def run(files: dict[str, str], argv: list[str], stdin: bytes, limits: Limits | None = None) -> RunOutput:
    """Run `Limits.python argv` on `files` in the sandbox; `stdin` is the program's input. Raises SandboxRefused."""
    limits = as_limits(limits)
    isolate = isolated(limits)
    with _concurrency:
        return _run(files, argv, stdin, limits, isolate)


@contextmanager
def _uid_slot():
    """A sandbox uid held by this run alone on this host (root only; None otherwise)."""
    if os.geteuid() != 0:
        yield None
        return
    _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    start = int.from_bytes(os.urandom(2), "little") % UID_SLOTS
    while True:
        for i in range(UID_SLOTS):
            slot = (start + i) % UID_SLOTS
            fd = os.open(_LOCK_DIR / str(slot), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                sweep(UID_BASE + slot, files=False)  # what a run of a crashed host process left
                yield UID_BASE + slot
            finally:
                os.close(fd)
            return
        time.sleep(0.05)


def _user_tasks(uid: int) -> int:
    return sum(p.info["num_threads"] or 0 for p in psutil.process_iter(["uids", "num_threads"])
               if p.info["uids"] and p.info["uids"].real == uid)


def _run(files, argv, stdin, limits: Limits, isolate: bool) -> RunOutput:
    with _uid_slot() as uid, tempfile.TemporaryFile() as stdin_file:
        workdir = tempfile.mkdtemp(prefix="aligner-sandbox-run-")
        try:
            for name, text in files.items():
                Path(workdir, name).write_text(text)
            stdin_file.write(stdin)
            stdin_file.seek(0)
            nproc = limits.processes if uid is not None else _user_tasks(os.getuid()) + limits.processes
            cfg = {"isolate": isolate, "uid": uid, "gid": uid, "host_workdir": workdir, "python": interpreter(limits),
                   "argv": argv, "env": ENV, "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20,
                   "file_bytes": limits.file_mb << 20, "disk_mb": limits.disk_mb, "inodes": limits.inodes,
                   "nproc": nproc, "open_files": limits.open_files}
            start = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", sandbox_launch.__file__, json.dumps(cfg)],
                                    stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                                    env=ENV, start_new_session=True)
            try:
                out = _collect(proc, limits, start + limits.wall_s)
            finally:
                _kill_group(proc.pid)
                if uid is not None:
                    sweep(uid, files=not isolate)
                proc.wait()
            return replace(out, wall_s=time.monotonic() - start)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, limits: Limits, deadline: float) -> RunOutput:
    """Read stdout and stderr (capped) until the launcher exits or the deadline; kill the group on either limit
    and when the launcher exits (leftover processes may hold the pipes). The launcher is not reaped here, so
    that its process group id cannot be reused before it is killed."""
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    timed_out = overflow = False
    exited_at = None
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            selector.register(stream, selectors.EVENT_READ)
        while not overflow:
            now = time.monotonic()
            if exited_at is None and _exited(proc.pid):
                exited_at = now
                _kill_group(proc.pid)
            if exited_at is not None and (not selector.get_map() or now > exited_at + 1.0):
                break
            if now > deadline:
                timed_out = True
                break
            if not selector.get_map():  # the program closed its stdout and stderr: wait for it
                time.sleep(min(0.02, deadline - now))
                continue
            for key, _ in selector.select(min(0.05, deadline - now)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer += chunk[:limits.output_bytes + 1 - len(buffer)]
                overflow = overflow or len(buffer) > limits.output_bytes
    _kill_group(proc.pid)
    while not _exited(proc.pid):  # SIGKILLed with its group: a matter of milliseconds
        time.sleep(0.005)
    for stream in buffers:
        stream.close()
    code = _exit_code(proc.pid)
    stdout, stderr = (bytes(b[:limits.output_bytes]) for b in buffers.values())
    setup = ""
    if code == sandbox_launch.SETUP_FAILED and not (timed_out or overflow):
        lines = [line for line in stderr.decode(errors="replace").splitlines()
                 if line.startswith(sandbox_launch.PREFIX)]
        setup = lines[-1][len(sandbox_launch.PREFIX):] if lines else ""
    return RunOutput(None if timed_out or overflow else code, stdout, stderr, timed_out, overflow, setup)


def _exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _exit_code(pid: int) -> int:
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info.si_status if info.si_code == os.CLD_EXITED else 128 + info.si_status


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def sweep(uid: int, files: bool = True) -> None:
    """Kill every process of `uid` (a sandbox uid, as root); with `files`, remove its top-level entries in the
    host's world-writable directories (unisolated runs can write there)."""
    for _ in range(100):
        left = [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and uid in p.info["uids"][:2]]
        if not left:
            break
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=0.1)
    for shared in {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"} if files else ():
        try:
            entries = list(os.scandir(shared))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
            except OSError:
                pass
