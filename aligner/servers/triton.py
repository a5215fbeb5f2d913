"""The PyTriton adapter: the one server-side module that imports pytriton.

`serve_bindings` binds endpoints (`protocol.Endpoint`) to Python callables and runs until SIGTERM/SIGINT:
* HTTP on `server.port`, gRPC on port + 1 and metrics on port + 2 unless set, all bound to
  `server.host` (127.0.0.1 by default; PyTriton's own default is 0.0.0.0);
* the ports are checked free first (a clash would otherwise let PyTriton's start-up talk to the
  other server), tritonserver's log goes to `server.log_file`, and in-flight requests get
  `server.exit_timeout_s` to finish when stopping;
* the workspace is a fresh temporary directory, removed on exit;
* once every model answers, a ready file (JSON: pid, url, models) is written atomically; launchers
  wait for it *and* for the process to be alive (see `process.ServerProcess`).
A callable receives the list of requests of one merged call (dicts of numpy arrays) and returns one
dict of outputs per request. An exception fails that call with its message; the server keeps serving.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import logging
import os
import shutil
import signal
import socket
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from aligner.errors import UserError
from aligner.files import atomic_write
from aligner.runtime.optional import require
from aligner.servers.protocol import Endpoint

# pytriton is imported inside the functions that serve: it is optional (the `serve` extra), and the CLI
# process imports this module (port checks) before it launches ranks.

log = logging.getLogger(__name__)


def fix_libpython() -> None:
    """Put this interpreter's shared libpython first on LD_LIBRARY_PATH, before tritonserver starts.

    PyTriton's Python-backend stub links `libpython3.X.so.1.0`; without this the dynamic linker may
    pick the system's libpython of another patch release, which then runs this interpreter's
    stdlib and every model fails to load (`'_thread.RLock' object has no attribute
    '_recursion_count'`, pytriton#51). tritonserver inherits os.environ, so setting it here is enough."""
    libdir, library = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY") or ""
    if not (sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and (Path(libdir) / library).exists()):
        raise RuntimeError(f"this Python ({sysconfig.get_config_var('prefix')}) has no shared libpython, which "
                           "PyTriton's backend needs; use a Python built with --enable-shared (pyenv: "
                           "PYTHON_CONFIGURE_OPTS=--enable-shared) or the distribution's python3")
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p and p != libdir]
    os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *parts])


def ports(server) -> tuple[int, int, int]:
    """(HTTP, gRPC, metrics) ports of a ServerConfig."""
    return (server.port, server.grpc_port if server.grpc_port is not None else server.port + 1,
            server.metrics_port if server.metrics_port is not None else server.port + 2)


class PortBusy(UserError, OSError):
    pass


def check_ports_free(host: str, numbers) -> None:
    for port in numbers:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise PortBusy(f"port {port} on {host} is not available ({e.strerror}); another server may be "
                               f"using it", "server.port", "stop it or set server.port (HTTP P, gRPC P+1, metrics P+2)"
                               ) from None


@dataclass(frozen=True)
class Binding:
    endpoint: Endpoint
    function: Callable[[list], list]  # requests -> one output dict per request
    max_batch_size: int


def _write_ready_file(path: Path, info: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        f.write(json.dumps(info))


# Triton's Python backend declares a model's stub dead ("Stub process '...' is not healthy", and the request fails)
# when the stub's health thread, which wakes every 300 ms, has not run within a 1-s window of a request's wait
# (python_backend, stub_launcher.cc; not configurable). With the kernel's session autogroups (sched_autogroup), a
# thread waking in a busy session can wait longer than that on a CPU where its session has little load: beside the
# tiny example's two PPO runs and a GRPO run on two cores, a 300 ms sleeper in a PPO run's session overslept by up to
# 1.6 s, at nice 0 and at nice -10 alike; with autogroups off, by 6 ms at most. Real-time threads are scheduled
# outside the autogroups, so the stubs' threads (they only relay requests) run round-robin at the lowest real-time
# priority where the OS allows it (root, or CAP_SYS_NICE); elsewhere they stay as they are.
STUB_PRIORITY = 1


def prioritise_stubs() -> None:
    """Every thread of this process's model stubs (tritonserver's children) to SCHED_RR at STUB_PRIORITY (Linux
    schedules threads, and the stubs' health threads already exist); nothing where that is not permitted."""
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name().startswith("triton_python_backend_stub"):
                for thread in child.threads():
                    os.sched_setscheduler(thread.id, os.SCHED_RR, os.sched_param(STUB_PRIORITY))
        except PermissionError:
            return  # neither root nor CAP_SYS_NICE: the same for every stub
        except (ProcessLookupError, psutil.Error):
            continue  # a stub or thread that has just exited


def skip_config_autocompletion(triton) -> None:
    """Start tritonserver with `--strict-model-config=true`: its Python backend then skips the stub it launches per
    model only to let `model.py` complete the model's config. PyTriton writes every config whole and its `model.py`
    completes nothing, so that stub changes nothing, and costs ~1.6 s of each model's ~2.4 s load on a CPU core (a
    five-model critic service: ready ~8 s sooner). PyTriton 0.7.0's `TritonConfig` has no field for the option (its
    server config does), and tritonserver's newer `--disable-auto-complete-config` takes no value, which PyTriton's
    `--key=value` command line cannot pass; so it goes into the server config that `Triton.run()` turns into
    tritonserver's command line (which prints one line at start calling the option deprecated). Without that
    attribute (another PyTriton) models load the slow way."""
    server_config = getattr(triton, "_triton_server_config", None)
    if server_config is not None:
        server_config["strict-model-config"] = "true"


@contextlib.contextmanager
def real_time_while_loading():
    """Start tritonserver and load the models with this thread at STUB_PRIORITY, so that tritonserver and the stubs
    it forks inherit it: the Python backend gives a new stub 10 s to start its health thread and 5 s to initialise
    (stub_launcher.cc, not configurable), which a stub at the ordinary policy missed on an overloaded host (two
    example scripts' PPO runs, GRPO and a critic service on two cores: a model took 6.3 s to load, the next one
    timed out and tritonserver aborted). Afterwards every thread of this process and of tritonserver goes back
    to the ordinary policy (the server's own compute must not run at real-time priority); `prioritise_stubs` then
    keeps the stubs where they were. Without the permission (neither root nor CAP_SYS_NICE) nothing changes."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(STUB_PRIORITY))
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        ordinary = os.sched_param(0)
        processes = [psutil.Process(), *(c for c in psutil.Process().children(recursive=True)
                                         if not c.name().startswith("triton_python_backend_stub"))]
        for process in processes:
            try:
                for thread in process.threads():
                    with contextlib.suppress(ProcessLookupError):  # a thread that has just exited
                        os.sched_setscheduler(thread.id, os.SCHED_OTHER, ordinary)
            except psutil.Error:
                continue  # a process that has just exited


def _tensors(specs):
    from pytriton.model_config import Tensor  # optional (aligner[serve])

    return [Tensor(name=s.name, dtype=s.dtype, shape=s.shape, optional=s.optional) for s in specs]


def _plain_requests(function):
    """PyTriton passes `Request` objects; our callables take plain dicts of numpy arrays."""
    def call(requests):
        return function([dict(r.items()) for r in requests])

    return call


def serve_bindings(server, run_dir, bindings: list[Binding], stop: threading.Event | None = None) -> None:
    """Serve `bindings` until SIGTERM/SIGINT (or `stop` is set); blocks. Call from the main thread."""
    fix_libpython()
    require("pytriton")
    from pytriton.model_config import DynamicBatcher, ModelConfig  # optional (aligner[serve]), required above
    from pytriton.triton import Triton, TritonConfig

    logging.getLogger("pytriton").setLevel(logging.WARNING)
    stop = stop or threading.Event()

    def asked_to_stop(*_):
        stop.set()
        # a stop still under way after 20 s (launchers kill at 30) writes every thread's stack to stderr: where
        # it waits (a CI run saw a TP=2 reward server's rank 0 stop hang once, past its tritonserver's exit)
        faulthandler.dump_traceback_later(20, exit=False)

    previous = {s: signal.signal(s, asked_to_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    http, grpc, metrics = ports(server)
    check_ports_free(server.host, (http, grpc, metrics))
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_file = Path(server.log_file or run_dir / "tritonserver.log")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    config = TritonConfig(http_address=server.host, grpc_address=server.host, metrics_address=server.host,
                          http_port=http, grpc_port=grpc, metrics_port=metrics, log_file=log_file,
                          exit_timeout_secs=server.exit_timeout_s)
    scratch = Path(tempfile.mkdtemp(prefix="aligner-triton-"))
    ready_file = Path(server.ready_file) if server.ready_file else None
    triton = Triton(config=config, workspace=scratch / "workspace")
    skip_config_autocompletion(triton)
    try:
        for b in bindings:
            batcher = DynamicBatcher(max_queue_delay_microseconds=server.max_queue_delay_us) if b.endpoint.batched else None
            triton.bind(model_name=b.endpoint.name, infer_func=_plain_requests(b.function),
                        inputs=_tensors(b.endpoint.inputs),
                        outputs=_tensors(b.endpoint.outputs), strict=True,
                        config=ModelConfig(batching=b.endpoint.batched, max_batch_size=b.max_batch_size,
                                           batcher=batcher))
        # the models and libraries live as long as the server: out of the collector's sight, the full collection
        # PyTriton runs as it unloads each model takes ~0 s instead of ~0.25 s
        gc.freeze()
        with real_time_while_loading():
            triton.run()
        prioritise_stubs()
        url = f"http://{server.host}:{http}"
        models = [b.endpoint.name for b in bindings]
        if ready_file:
            _write_ready_file(ready_file, {"pid": os.getpid(), "url": url, "grpc_port": grpc, "metrics_port": metrics,
                                           "models": models})
        log.info("serving %s at %s (gRPC :%d, metrics :%d, log %s)", ", ".join(models), url, grpc, metrics, log_file)
        while not stop.wait(0.5):
            if not triton.is_alive():
                raise RuntimeError(f"tritonserver stopped unexpectedly; see {log_file}")
        log.info("stopping the server")
    finally:
        if ready_file:
            ready_file.unlink(missing_ok=True)
        triton.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
