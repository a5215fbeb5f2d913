"""Start, await and stop an `aligner serve <kind>` process (tests, benchmarks, local launchers); it forks
from a live zygote when `ALIGNER_ZYGOTE` names one (aligner/launch/zygote.py), else starts fresh.

Ready means all of: the process still runs; it wrote its ready file (after every model loaded);
the pid in that file is the process or one of its descendants; every model answers its HTTP
readiness URL. So a port clash never passes for readiness: the new server exits, and the server
that holds the port is not ours. Stopping sends SIGTERM to the process (the server finishes
in-flight requests, the launcher forwards the signal to its ranks), then SIGKILL to whatever of its
process tree is left after the grace period; only processes of that tree are ever signalled.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from aligner.launch import zygote
from aligner.servers.client import EndpointClient

MODELS = {"reward": ("reward_model",), "critic": ("critic_infer", "critic_train", "critic_save"),
          "verifier": ("verifier",)}


# A server is a job of its own: started from a training rank (PPO's embedded service) it must not take that
# rank's place in the trainer's process group, nor think an outer launcher started it.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "ALIGNER_ERROR_FILE", "ALIGNER_LOG_DIR", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


class ServerFailed(RuntimeError):
    pass


def free_port_block(host: str = "127.0.0.1", n: int = 3, low: int = 20000, high: int = 32000) -> int:
    """A base port p with p..p+n-1 free (HTTP, gRPC, metrics), below Linux's ephemeral range so that
    no outgoing connection takes one before the server binds it. Best effort: bind-checked now. Drawn
    from the OS's entropy, not `random`'s global state: a trainer seeds that, and two runs of one seed
    would otherwise pick the same ports."""
    draw = random.SystemRandom()
    for _ in range(500):
        base = draw.randrange(low, high - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high}) on {host}")


class ServerProcess:
    def __init__(self, kind: str, overrides: list[str], run_dir, *, port: int, host: str = "127.0.0.1",
                 env: dict | None = None):
        self.kind, self.host, self.port, self.overrides = kind, host, port, list(overrides)
        self.run_dir = Path(run_dir)
        self.ready_file = self.run_dir / "ready.json"
        self.log_path = self.run_dir / "server.log"
        self.command = [sys.executable, "-m", "aligner.cli", "serve", kind, f"run_dir={self.run_dir}",
                        f"server.host={host}", f"server.port={port}", f"server.ready_file={self.ready_file}", *overrides]
        self.env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None
        self._terminated = False
        # every process seen in the server's tree (psutil.Process: a pid reused since is not taken for it)
        self.tree: dict[int, psutil.Process] = {}

    def start(self) -> "ServerProcess":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = zygote.popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        self.tree = {self.proc.pid: psutil.Process(self.proc.pid)}
        self._terminated = False
        return self

    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _remember_tree(self) -> None:
        for p in self._descendants():
            self.tree.setdefault(p.pid, p)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        models = MODELS[self.kind]
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the {self.kind} server on {self.host}:{self.port} exited with code "
                                   f"{self.proc.returncode} before it was ready:\n{self.log_tail()}")
            self._remember_tree()
            if self.ready_file.exists():
                info = json.loads(self.ready_file.read_text())
                ours = info["pid"] == self.proc.pid or info["pid"] in {p.pid for p in self._descendants()}
                if ours and all(EndpointClient(self.host, self.port, m).is_ready() for m in info["models"]) \
                        and set(models) <= set(info["models"]):
                    self._remember_tree()
                    return self
            if time.monotonic() > deadline:
                raise ServerFailed(f"the {self.kind} server on {self.host}:{self.port} was not ready after "
                                   f"{timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.2)

    @property
    def serving_pid(self) -> int:
        """The pid that hosts PyTriton (rank 0), from the ready file."""
        return json.loads(self.ready_file.read_text())["pid"]

    def _running(self) -> list[psutil.Process]:
        running = []
        for p in self.tree.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    running.append(p)
            except psutil.NoSuchProcess:
                pass
        return running

    def alive(self) -> list[int]:
        """Pids of the server's tree that still run (zombies excluded)."""
        return [p.pid for p in self._running()]

    def kill(self) -> None:
        """SIGKILL the whole server tree at once (a crash); returns once every process of it is gone."""
        self._remember_tree()
        running = self._running()
        for p in running:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        psutil.wait_procs(running, timeout=10)

    def terminate(self) -> None:
        """SIGTERM (once) without waiting: stop several servers at once, then `stop` each."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self._remember_tree()
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, then SIGKILL what is left of the tree. Returns the exit code."""
        if self.proc is None:
            return None
        self._remember_tree()
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while self.alive() and time.monotonic() < deadline:  # stubs and tritonserver wind down after their parent
            time.sleep(0.2)
        if left := self._running():
            with open(self.log_path, "a") as log:  # which process outlived its server, for whoever reads the log
                for p in left:
                    with contextlib.suppress(psutil.Error):
                        log.write(f"aligner: killing pid {p.pid} ({' '.join(p.cmdline())[:200]}), still running "
                                  f"10 s after the {self.kind} server's exit\n")
            self.kill()
        return self.proc.wait()

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()
