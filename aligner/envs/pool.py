"""`EnvPool`: environments run in worker processes, calls concurrent up to `concurrency`, each under a deadline.

Why processes, as the reward functions' (`aligner.rewards.scoring`): environments are Python (a tool's
parsing, the sandbox's bookkeeping) that threads would run one at a time under the GIL, and a call that hangs
can only be stopped for sure by killing its process. Spawned, not forked, for the same reason as there.

An episode's environment lives in one worker for the whole episode (its state never travels): episode k of
a batch belongs to worker k mod `concurrency`, and a worker runs one call at a time, so at most
`concurrency` calls run at once. Deadlines, in two nets:
1. in the worker, SIGALRM at `timeout_s` interrupts the call (Python code, sleeps, the sandbox's waits): the
   call fails and the worker goes on;
2. in the host, a worker silent `grace_s` past the deadline (stuck in C code, or dead) is killed and a new one
   started; the environments it held are lost, so its other episodes fail at their next call.
A failed call is `(False, why)`: the caller ends that episode with `env.failure_reward`. The class must
construct: each worker builds one instance when it starts, and a class that cannot be built (a bad option,
a sandbox that cannot isolate) raises `EnvironmentUnavailable` in the host instead of failing every episode.
"""
from __future__ import annotations

import multiprocessing
import signal
import time
from collections import deque
from contextlib import contextmanager
from multiprocessing.connection import wait

from aligner.envs import resolve_environment
from aligner.envs.base import check_observation, check_step
from aligner.errors import UserError
from aligner.rewards.functions import worker_init
from aligner.runtime.preemption import STOP_SIGNAL


class EnvironmentUnavailable(UserError):
    """The environment class cannot be constructed in a worker process."""


class _Overrun(Exception):
    pass


def _alarm(signum, frame):
    raise _Overrun()


def serve(conn, name: str, options: dict, timeout_s: float) -> None:
    """A worker's loop: `(key, method, argument)` in, `(key, ok, result or why)` out; `("clear",)` drops every
    environment."""
    worker_init()
    signal.signal(signal.SIGALRM, _alarm)
    try:
        cls = resolve_environment(name)
        cls(**options)
    except Exception as e:  # noqa: BLE001 - whatever the class raises, the host reports it
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    envs: dict = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "clear":
            envs.clear()
            continue
        key, method, argument = message
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                if method == "reset":
                    envs[key] = cls(**options)
                    result = check_observation(envs[key].reset(argument), "reset")
                else:
                    result = check_step(envs[key].step(argument))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            reply = (key, True, result)
        except _Overrun:
            reply = (key, False, f"{method} ran past its deadline of {timeout_s:g} s (env.timeout_s)")
        except Exception as e:  # noqa: BLE001 - an environment's failure ends its episode, never the run
            reply = (key, False, f"{method} raised {type(e).__name__}: {str(e)[:500]}")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. an observation that cannot be pickled
            conn.send((key, False, f"{method}'s result cannot be sent to the trainer ({type(e).__name__}: {e})"))


@contextmanager
def _stop_signal_blocked():
    """SIGUSR1 blocked while a worker starts, so that it inherits the mask until `worker_init` ignores it."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [STOP_SIGNAL])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class _Worker:
    def __init__(self, context, name: str, options: dict, timeout_s: float, start_timeout_s: float):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, name, options, timeout_s), daemon=True)
        with _stop_signal_blocked():
            self.process.start()
        child.close()
        self.name, self.start_timeout_s = name, start_timeout_s
        self.keys: set = set()  # the episodes whose environments it holds
        self.call = None  # (index of the call, deadline) in flight

    def wait_ready(self) -> "_Worker":
        """Wait for the worker's first message: raises EnvironmentUnavailable unless it built the class."""
        name, start_timeout_s = self.name, self.start_timeout_s
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise EnvironmentUnavailable(f"environment {name!r}: a worker process did not start within "
                                         f"{start_timeout_s:g} s", "env.name")
        message = self.conn.recv()
        if message[0] != "ready":
            self.kill()
            raise EnvironmentUnavailable(f"environment {name!r} cannot be constructed ({message[1]})", "env.name",
                                         "fix the environment class or its options")
        return self

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


class EnvPool:
    """`concurrency` worker processes running environment `name` (builtin or package.module:Class), each
    instance built as `cls(**options)`; see the module doc."""

    def __init__(self, name: str, options: dict | None = None, concurrency: int = 8, timeout_s: float = 30.0,
                 grace_s: float = 2.0, start_timeout_s: float = 120.0):
        if concurrency < 1 or timeout_s <= 0:
            raise ValueError(f"concurrency must be >= 1 and timeout_s > 0, got {concurrency} and {timeout_s}")
        resolve_environment(name)  # a ValueError naming the name, before any process starts
        self.name, self.options, self.timeout_s, self.grace_s = name, dict(options or {}), timeout_s, grace_s
        self.start_timeout_s = start_timeout_s
        self._context = multiprocessing.get_context("spawn")
        self.workers = [self._start(wait=False) for _ in range(concurrency)]  # started together, then awaited
        try:
            for worker in self.workers:
                worker.wait_ready()
        except EnvironmentUnavailable:
            self.close()
            raise
        self.lost: set = set()  # episodes whose worker was killed
        self.restarts = 0

    def _start(self, wait: bool = True) -> _Worker:
        worker = _Worker(self._context, self.name, self.options, self.timeout_s, self.start_timeout_s)
        return worker.wait_ready() if wait else worker

    def run(self, calls: list[tuple[int, str, object]]) -> list[tuple[bool, object]]:
        """Run `(episode, "reset" | "step", record | action)` calls, concurrently; `(True, result)` or `(False,
        why)` per call, in order. At most one call per episode."""
        results: list = [None] * len(calls)
        queues = [deque() for _ in self.workers]
        for index, (key, method, argument) in enumerate(calls):
            if method == "reset":
                self.lost.discard(key)
            if key in self.lost:
                results[index] = (False, "its environment was lost when a hung worker process was killed")
            else:
                queues[key % len(self.workers)].append((index, key, method, argument))
        while True:
            for w, worker in enumerate(self.workers):
                if worker.call is None and queues[w]:
                    index, key, method, argument = queues[w].popleft()
                    worker.keys.add(key)
                    worker.conn.send((key, method, argument))
                    worker.call = (index, time.monotonic() + self.timeout_s + self.grace_s)
            busy = [w for w in self.workers if w.call is not None]
            if not busy:
                return results
            wait([w.conn for w in busy], timeout=max(0.0, min(w.call[1] for w in busy) - time.monotonic()))
            for w, worker in enumerate(self.workers):
                if worker.call is None:
                    continue
                index, dead = worker.call[0], False
                try:
                    if worker.conn.poll():
                        key, ok, value = worker.conn.recv()
                        results[index], worker.call = (ok, value), None
                        continue
                except (EOFError, OSError):
                    dead = True
                if not dead and time.monotonic() < worker.call[1] and worker.process.is_alive():
                    continue
                why = f"the worker process running {calls[index][1]} died" if dead or not worker.process.is_alive() \
                    else f"{calls[index][1]} ran past its deadline of {self.timeout_s:g} s (env.timeout_s) and did " \
                         f"not stop: its worker process was killed"
                results[index] = (False, why)
                self.lost |= worker.keys - {calls[index][0]}
                worker.kill()
                self.workers[w] = self._start()
                self.restarts += 1

    def clear(self) -> None:
        """Drop every environment (between batches of episodes)."""
        for worker in self.workers:
            worker.conn.send(("clear",))
            worker.keys.clear()
        self.lost.clear()

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
