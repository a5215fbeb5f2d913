"""A warm process that forks ready-imported Python processes on request: start-up in milliseconds.

Every rank, command and server spends its first ~5 s of CPU importing torch, megatron-core and transformers,
most of the time of a test suite's jobs and of a laptop's edit-run loop. `serve` imports them and aligner once,
then forks one child per request, which becomes `python -m MODULE ARGS...` with the requester's environment,
working directory, signal mask, process group (or a new session) and standard streams, as a fresh one would.

    python -m aligner.launch.zygote SOCKET &   # imports once (seconds), then serves until its parent exits
    ALIGNER_ZYGOTE=SOCKET aligner train ...    # the command, its ranks and servers start through it

`popen` is what the launcher and the tests' CLI helpers call instead of subprocess.Popen: through the zygote when
`ALIGNER_ZYGOTE` names a live one in the requester's session (or the child starts a session of its own), else a plain
Popen. A child can join the requester's process group only from the same session, so a server, which runs in a session
of its own, starts its ranks as plain processes; the server itself (servers/process.py) forks, in a session of its
own: ready in ~2.5 s of CPU against ~9 s fresh (a critic service, 2026-12-07). Only a process's parent can wait for
it, so the zygote sends each child's wait status back on the request's connection, and `ZygoteProcess` (a Popen) reads
it there; signals go to the child's pid directly.

What differs from a fresh interpreter: dependencies' import-time warnings were shown once, by the zygote; hash
randomisation is the zygote's; the process's parent is the zygote, and its command line in /proc and ps is a title
written over the zygote's (its arguments joined by spaces); torch and megatron are loaded before its first line runs.
Under Slurm `popen` never uses it: a job's processes must stay in the job's allocation and receive its signals.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import pkgutil
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
import weakref
from pathlib import Path

from aligner.errors import end_process

ZYGOTE_VARIABLE = "ALIGNER_ZYGOTE"
# what a rank, a command or a server imports before its first line of work (the seconds a fork saves)
PRELOAD = ("torch", "torch._dynamo", "numpy", "transformers", "safetensors", "omegaconf", "megatron.core",
           "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.dist_checkpointing",
           "megatron.core.distributed", "megatron.core.pipeline_parallel", "aligner")
# transformers imports its classes on first use, scanning ~600 model folders to find them (~0.9 s): resolved
# here once, they are ready in every child
RESOLVE = {"transformers": ("AutoTokenizer", "PreTrainedTokenizerFast", "AutoConfig", "AutoModelForCausalLM")}
_WORD = struct.Struct("!q")  # a pid, then a wait status: fixed-size, so that poll() sees exactly what is unread


# ---- the zygote -------------------------------------------------------------------------------------------

def preload(modules=PRELOAD) -> None:
    """Import `modules` (and resolve their RESOLVE attributes) and, for "aligner", every module of the package,
    warnings held back (module doc)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            module = importlib.import_module(name)
            for attribute in RESOLVE.get(name, ()):
                getattr(module, attribute)
            if name == "aligner":
                for info in pkgutil.walk_packages(module.__path__, "aligner."):
                    with contextlib.suppress(ImportError):  # an optional dependency (TensorRT-LLM, TE) is absent
                        importlib.import_module(info.name)


def serve(path: str | Path, modules=PRELOAD) -> None:
    """Preload, then fork a child for each request on the Unix socket `path` until our parent exits.
    One thread only: a fork copies just the calling thread, so there must be no other to hold a lock."""
    os.environ["OMP_NUM_THREADS"] = "1"  # else importing torch starts an OpenMP thread; children set their own
    # a CUDA driver initialised here would be unusable in every fork: torch.cuda.is_available() (megatron_jit
    # asks it as megatron is imported) counts devices through NVML instead of initialising the driver
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    preload(modules)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("the zygote initialised CUDA while preloading; its forks could not use the GPU")
    # what was imported lives as long as any child: out of the collector's sight, a child's full collection
    # walks its own objects only (0.23 s -> ~0 here; PyTriton collects at every model's unload)
    gc.freeze()
    parent, me = os.getppid(), os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = f"{path}.{me}"
    listener.bind(partial)
    listener.listen(128)
    os.replace(partial, path)  # the socket appears only once the imports are done
    children: dict[int, socket.socket] = {}
    try:
        while os.getppid() == parent:
            if _readable(listener, 0.02):
                connection, _ = listener.accept()
                try:
                    request, fds = _receive(connection)
                except (OSError, ValueError, struct.error):  # a requester that changed its mind (OtherSession)
                    connection.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                # the child holds every signal until it takes the requester's mask (a stop asked at once waits)
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                pid = os.fork()
                if pid == 0:
                    _become(request, fds)  # never returns: the child exits from there
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                list(map(os.close, fds))
                connection.sendall(_WORD.pack(pid))
                children[pid] = connection
            _report_exits(children)
    finally:
        if os.getpid() == me:
            Path(path).unlink(missing_ok=True)


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(connection, 65536, 3)
    if len(fds) != 3:
        list(map(os.close, fds))
        raise ValueError("a request carries the three standard streams")
    (size,) = _WORD.unpack(head[:_WORD.size])
    body = bytearray(head[_WORD.size:])
    while len(body) < size:
        body += connection.recv(size - len(body))
    return json.loads(body), fds


def _report_exits(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError), connection:  # OSError: the requester is gone; so be it
                connection.sendall(_WORD.pack(status))


_forked = False  # this process is a child the zygote forked (`forked_here`)


def forked_here() -> bool:
    return _forked


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the requester's process context, then run the module as `python -m`."""
    importlib.import_module("aligner.launch.zygote")._forked = True  # not __main__'s, which the zygote runs as
    zygote_pythonpath = _entries(os.environ.get("PYTHONPATH"))
    if request["new_session"]:
        os.setsid()
    else:
        with contextlib.suppress(OSError):  # the requester's group: signals to it reach us, as to a Popen child
            os.setpgid(0, request["pgid"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # Popen's close_fds: the zygote's sockets are not the child's
    os.chdir(request["cwd"])
    for finalizer in list(weakref.finalize._registry):  # noqa: SLF001 - the zygote's own (its temporary folders
        finalizer.atexit = False                          # among them) are its to run at its exit, not ours
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_streams()
    signal.pthread_sigmask(signal.SIG_SETMASK, request["sigmask"])
    _fresh_libraries()
    sys.path[:] = _fresh_path(request["cwd"], zygote_pythonpath)
    sys.argv = [request["module"], *request["argv"]]
    _retitle([sys.executable, "-m", request["module"], *request["argv"]])
    sys.modules.pop(request["module"], None)  # preloaded as a module; `python -m` executes a fresh copy as __main__
    code = 1
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
    finally:
        _exit(code)


def _retitle(argv: list[str]) -> None:
    """Show `argv` as this process's command line (ps, psutil, /proc/PID/cmdline), as setproctitle does: written
    over the zygote's own argument strings, which `main` padded for this. The kernel reads such a title up to
    its first NUL, so the arguments are joined by spaces."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end: stat's fields 48 and 49
    title = " ".join(argv).encode(errors="replace")[:end - start - 2] + b"\0"
    ctypes.memmove(start, title, len(title))
    ctypes.memmove(end - 1, b".", 1)  # a last byte other than NUL marks the area as a title


def _exit_code(code) -> int:
    """SystemExit's code as the interpreter turns it into an exit status (a message is printed, status 1)."""
    if code is None or isinstance(code, int):
        return (code or 0) & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """Exit as an interpreter would, up to its finalisation, which a forked child skips (as multiprocessing's
    do): tearing down the zygote's thousands of modules and destructing objects that predate the fork is
    slow, and torch's TCPStore daemon can spin forever in a destructor run then."""
    try:
        threading._shutdown()  # wait for non-daemon threads, as the interpreter does first  # noqa: SLF001
        atexit._run_exitfuncs()  # noqa: SLF001
    finally:
        end_process(code)


def _entries(pythonpath: str | None) -> list[str]:
    return [os.path.abspath(p) for p in (pythonpath or "").split(os.pathsep) if p]


def _fresh_path(cwd: str, zygote_pythonpath: list[str]) -> list[str]:
    """sys.path as `python -m` in `cwd` with this environment's PYTHONPATH builds it: the working directory,
    PYTHONPATH's entries, then the interpreter's own (the zygote's, less its PYTHONPATH's)."""
    own = [p for p in sys.path[1:] if os.path.abspath(p) not in zygote_pythonpath]
    return [cwd, *_entries(os.environ.get("PYTHONPATH")), *own]


def _fresh_streams() -> None:
    """Python's standard streams on the new fds 0-2, buffered as a fresh interpreter would buffer them."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def stream(fd: int, mode: str, line_buffering: bool):
        raw = io.FileIO(fd, mode, closefd=False)
        binary = raw if unbuffered and mode == "w" else (io.BufferedWriter(raw) if mode == "w" else io.BufferedReader(raw))
        return io.TextIOWrapper(binary, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                line_buffering=line_buffering, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = stream(0, "r", False)
    sys.stdout = sys.__stdout__ = stream(1, "w", os.isatty(1))
    sys.stderr = sys.__stderr__ = stream(2, "w", True)


def _fresh_libraries() -> None:
    """What preloaded libraries read from the environment at import, read again: torch's thread count; and
    numpy's global generator seeded anew, as each fresh process's is (forks would share the zygote's)."""
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None:
        threads = os.environ.get("OMP_NUM_THREADS", "")
        # OpenMP may start its workers here: with every signal blocked, as a fresh process's workers start once its
        # CLI has blocked SIGUSR1 (runtime/preemption.py), or a SIGUSR1 would reach one and kill the process
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else os.cpu_count() or 1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if numpy is not None:
        numpy.random.seed()


# ---- the requester ----------------------------------------------------------------------------------------

def zygote_socket(env=None) -> str | None:
    """The live zygote's socket that ALIGNER_ZYGOTE names in `env` (default: ours), or None (unset or empty, not
    ready yet, or under Slurm)."""
    env = os.environ if env is None else env
    path = env.get(ZYGOTE_VARIABLE)
    if not path or "SLURM_JOB_ID" in env or not Path(path).is_socket():
        return None
    return path


def popen(args: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(args, **kwargs); `[sys.executable, "-m", MODULE, ...]` forks from the zygote when one is
    live (module doc)."""
    path = zygote_socket(kwargs.get("env"))  # the child's environment decides
    runs_module = len(args) >= 3 and args[0] == sys.executable and args[1] == "-m"
    if path is None or not runs_module:
        return subprocess.Popen(args, **kwargs)
    try:
        return ZygoteProcess(path, args, **kwargs)
    except UNREACHABLE:
        return subprocess.Popen(args, **kwargs)


def run(args: list[str], *, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs), started by `popen`."""
    with popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()  # Popen's exit waits for it
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


class ZygoteProcess(subprocess.Popen):
    """A Popen whose process the zygote forked. Popen's machinery (pipes, communicate, timeouts, signals) is
    reused; only starting the process and waiting for it (which goes through the zygote's report) differ."""

    def __init__(self, path: str, args: list[str], **kwargs):
        self._zygote_path = path
        self._report: socket.socket | None = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        start_new_session = rest[-2]  # Popen passes (..., start_new_session, process_group) last
        if preexec_fn is not None or pass_fds or shell or executable not in (None, sys.executable):
            raise ValueError("the zygote starts `python -m MODULE` only, without preexec_fn, pass_fds or a shell")
        request = {"module": args[2], "argv": list(map(str, args[3:])),
                   "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()),
                   "sigmask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                   "pgid": os.getpgrp(), "new_session": bool(start_new_session)}
        body = json.dumps(request).encode()
        fds = [fd if fd != -1 else target for target, fd in enumerate((p2cread, c2pwrite, errwrite))]
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self._zygote_path)
            if not start_new_session and os.getsid(_peer_pid(connection)) != os.getsid(0):
                raise OtherSession  # a child can join our process group only from our session
            socket.send_fds(connection, [_WORD.pack(len(body)) + body], fds)
            (self.pid,) = _WORD.unpack(_read(connection, _WORD.size))
        except BaseException:
            connection.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._report = connection
        self._child_created = True

    def _relayed_waitpid(self, pid: int, flags: int) -> tuple[int, int]:
        """os.waitpid for our child: its wait status as the zygote reported it; where the zygote died first (a
        timeout may end both), a SIGKILL status once the child is gone too, as the real status went with it."""
        if flags & os.WNOHANG and not _readable(self._report, 0):
            return 0, 0
        try:
            status = _WORD.unpack(_read(self._report, _WORD.size))[0]
        except ChildProcessError:
            while _alive(self.pid):
                if flags & os.WNOHANG:
                    return 0, 0
                time.sleep(0.05)
            status = signal.SIGKILL
        self._report.close()
        return self.pid, status

    def _try_wait(self, wait_flags):
        return self._relayed_waitpid(self.pid, wait_flags)

    def _internal_poll(self, _deadstate=None, **_):
        if self._report is None or self._report.fileno() == -1:  # nothing started, or already reported
            return self.returncode if self.returncode is not None or _deadstate is None else _deadstate
        return super()._internal_poll(_deadstate, _waitpid=self._relayed_waitpid)


class OtherSession(Exception):
    """The zygote is not in the requester's session, so its child could not join the requester's process group."""


UNREACHABLE = (ConnectionRefusedError, FileNotFoundError, OtherSession)  # it exited since we looked, or OtherSession


def _peer_pid(connection: socket.socket) -> int:
    pid, _, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    """poll(2), not select(2): a long-lived requester (the test session) holds fds numbered past select's 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _alive(pid: int) -> bool:
    """Whether `pid` runs, a zombie not counted (an orphan of a dead zygote is no child of ours to wait for)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def _read(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ChildProcessError("the zygote went away before it reported the process's exit")
        data += chunk
    return data


TITLE_ROOM = 1 << 15  # bytes of padding in the zygote's command line: room for its children's (`_retitle`)


def start(folder: Path, cwd: str | Path, env: dict | None = None) -> subprocess.Popen:
    """A zygote serving on `folder`/socket (ready once that socket exists), its output in `folder`/zygote.log: the
    test session's (tests/conftest.py) and the device kit's (bench/accept_zygote.py)."""
    with open(Path(folder) / "zygote.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "aligner.launch.zygote", str(Path(folder) / "socket")], cwd=cwd,
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def main(argv: list[str]) -> None:
    """`python -m aligner.launch.zygote SOCKET`: re-executes itself once with padded arguments, then serves."""
    if len(argv) == 1:
        os.execv(sys.executable, [sys.executable, "-m", "aligner.launch.zygote", argv[0], "." * TITLE_ROOM])
    serve(argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])
