"""`RewardScorer`: the rewards of a batch of rollout samples, computed while the loop goes on.

A sample's reward is the weighted sum of the reward functions' rewards (`aligner.rewards.functions`), plus,
with `url`, the reward of a running `aligner serve reward` or `aligner serve verifier` server (weight 1).
It is None when any term is missing (a function returned None, raised or returned a non-finite number; the
server refused the sample or did not answer in time): the loop leaves such a sample out, it never scores 0.

Why worker processes (`workers` of them) rather than threads: reward functions are mostly CPU-bound Python
(regexes, math-verify's sympy), which threads would run one at a time under the GIL, taking it from the
trainer's own Python meanwhile; and math-verify's timeouts only work on a main thread
(`aligner.rewards.math`), which is where a worker runs its tasks. So a function must be picklable: the
builtins and module-level `package.module:function`s are (checked at construction). The workers are
spawned, not forked: rank 0 runs CUDA and threads, which a fork would copy in an undefined state. Each
batch is cut into `workers` contiguous chunks. A worker that dies (a crash, the OOM killer) leaves its batch
unscored; the next batch gets fresh workers.

The server at `url` is told apart by the model it serves (found at the first batch, polled for up to
`remote_timeout_s`): a verifier gets the responses and each record's `answer`, or else its `tests` (a
sample with neither is unscored); a reward model gets prompt + response, as token ids encoded the way
reward-model training encodes text (`encode_for_reward`) when a `tokenizer` is given (the policy's: the
reward model must share its vocabulary), else as text, which the server tokenizes with its own. A reward
model with several outputs must merge them on the server (`reward.attribute_weights`).
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import pickle
import signal
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from aligner.data.preference_rm import encode_for_reward
from aligner.rewards.functions import (RewardFunction, function_name, resolve_reward_functions, score_rows,
                                       worker_init)
from aligner.runtime.preemption import STOP_SIGNAL
from aligner.servers.client import EndpointClient, RewardClient, ServerUnavailable

__all__ = ["RewardScorer", "RemoteReward", "resolve_reward_functions"]  # resolve_...: torch-free in .functions

log = logging.getLogger(__name__)


@contextmanager
def _stop_signal_blocked():
    """SIGUSR1 (a stop request for the ranks, which Slurm sends to every process of the job) blocked in this
    thread meanwhile: processes started inside inherit the mask, so the signal cannot kill them before
    `worker_init` ignores it (the launcher starts its ranks the same way, launch/local.py)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [STOP_SIGNAL])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def verifier_reference(record: dict) -> str | None:
    """What a verifier server checks a response against: the record's `answer`, else its `tests` (JSON text,
    the code verifiers' input, as `aligner.rewards.code` reads them); None when it has neither."""
    if record.get("answer") is not None:
        return str(record["answer"])
    tests = record.get("tests")
    if tests is None:
        return None
    return tests if isinstance(tests, str) else json.dumps(tests)


class RemoteReward:
    """The reward of the server at `url` ("host:port"), a reward model or a verifier (see the module doc)."""

    MODELS = ("reward_model", "verifier")

    def __init__(self, url: str, timeout_s: float = 60.0, tokenizer=None):
        host, _, port = url.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"the reward server's url must be host:port, got {url!r}")
        self.host, self.port, self.timeout_s, self.tokenizer = host, int(port), timeout_s, tokenizer
        self.client: RewardClient | None = None

    def _connect(self) -> RewardClient | None:
        """The client of the model the server serves; None when it serves neither within timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while self.client is None:
            model = next((m for m in self.MODELS if EndpointClient(self.host, self.port, m).is_ready()), None)
            if model is not None:
                self.client = RewardClient(self.host, self.port, model, timeout_s=self.timeout_s)
            elif time.monotonic() > deadline:
                return None
            else:
                time.sleep(0.25)
        return self.client

    def wait_ready(self) -> None:
        """Before the first step: a server that is not there at all is a mistake in the URL, not a sample to mask."""
        if self._connect() is None:
            raise ServerUnavailable(f"no reward model or verifier server ready within {self.timeout_s:g} s",
                                    f"reward.url={self.host}:{self.port}",
                                    "start the server first (aligner serve reward|verifier), or correct reward.url")

    def rewards(self, prompts: list[str], responses: list[str], fields: list[dict]) -> list[float | None]:
        """One reward per sample, None where the server gave none. Blocks until the server answered."""
        rewards: list[float | None] = [None] * len(prompts)
        client = self._connect()
        if client is None:
            log.warning("no reward or verifier server ready at %s:%d within %g s: %d samples unscored", self.host,
                        self.port, self.timeout_s, len(prompts))
            return rewards
        if client.endpoint.model == "verifier":
            references = [verifier_reference(record) for record in fields]
            send = [i for i, reference in enumerate(references) if reference is not None]
            future = client.score(texts=[responses[i] for i in send], answers=[references[i] for i in send])
        else:
            send = list(range(len(prompts)))
            texts = [p + r for p, r in zip(prompts, responses)]
            future = client.score([encode_for_reward(self.tokenizer, t) for t in texts]) \
                if self.tokenizer is not None else client.score(texts=texts)
        failures = []
        for i, result in zip(send, future.result().results):
            if result.ok and result.value.shape == (1,):
                rewards[i] = float(result.value[0])
            else:
                failures.append(f"{result.status}: {result.message}" if not result.ok else
                                f"{result.value.shape[0]} rewards per sample; merge them on the server "
                                f"(reward.attribute_weights)")
        if failures:
            log.warning("%s at %s:%d left %d of %d samples unscored; the first: %s", client.endpoint.model,
                        self.host, self.port, len(failures), len(prompts), failures[0])
        return rewards

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class RewardScorer:
    """Weighted reward functions (on `workers` processes) plus an optional reward server; see the module doc."""

    def __init__(self, functions: list[RewardFunction], weights: list[float] | None = None, workers: int = 4,
                 url: str | None = None, remote_timeout_s: float = 60.0, tokenizer=None):
        self.functions = list(functions)
        self.weights = [1.0] * len(self.functions) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.functions):
            raise ValueError(f"{len(self.weights)} weights for {len(self.functions)} reward functions")
        if not self.functions and url is None:
            raise ValueError("nothing to score with: pass reward functions and/or the url of a reward or verifier "
                             "server")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        for fn in self.functions:
            try:
                pickle.dumps(fn)
            except Exception as e:  # PicklingError, AttributeError, TypeError, depending on the object
                raise ValueError(f"reward function {function_name(fn)} cannot be sent to the worker processes "
                                 f"({type(e).__name__}: {e}); define it at the top level of a module") from None
        self.workers = workers
        self._remote = RemoteReward(url, remote_timeout_s, tokenizer) if url is not None else None
        self._pool = self._start_pool() if self.functions else None
        self._collector = ThreadPoolExecutor(1, thread_name_prefix="reward-scorer")

    def wait_ready(self) -> None:
        """Raise ServerUnavailable when `url` names no reward or verifier server (see RemoteReward.wait_ready)."""
        if self._remote is not None:
            self._remote.wait_ready()

    def _start_pool(self) -> ProcessPoolExecutor:
        with _stop_signal_blocked():  # the pool's queues start multiprocessing's resource tracker process
            return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=worker_init)

    def submit(self, prompts: list[str], responses: list[str], fields: list[dict]) -> Future:
        """Future of the rewards of the samples `(prompts[i], responses[i], fields[i])`: `list[float | None]`."""
        if not len(prompts) == len(responses) == len(fields):
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses and {len(fields)} field dicts; "
                             f"expected one of each per sample")
        prompts, responses, fields = list(prompts), list(responses), list(fields)
        chunks = []
        if self._pool is not None:
            try:
                chunks = self._submit_chunks(prompts, responses, fields)
            except BrokenProcessPool:
                log.warning("a reward worker process died; starting new ones")
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._start_pool()
                chunks = self._submit_chunks(prompts, responses, fields)
        return self._collector.submit(self._gather, prompts, responses, fields, chunks)

    def _submit_chunks(self, prompts, responses, fields) -> list[tuple[int, int, Future]]:
        size = max(1, -(-len(prompts) // self.workers))
        bounds = [(start, min(start + size, len(prompts))) for start in range(0, len(prompts), size)]
        with _stop_signal_blocked():  # workers start inside pool.submit
            return [(a, b, self._pool.submit(score_rows, self.functions, prompts[a:b], responses[a:b], fields[a:b]))
                    for a, b in bounds]

    def submit_each(self, prompts: list[str], responses: list[str], fields: list[dict]) -> Future:
        """Future of each function's own (unweighted) rewards: `{name: [float | None per sample]}`; the
        reward server, if any, is not asked."""
        chunks = self._submit_chunks(list(prompts), list(responses), list(fields)) if self._pool is not None else []

        def gather():
            rows = self._rows(len(prompts), chunks)
            return {function_name(fn): [row[k] for row in rows] for k, fn in enumerate(self.functions)}

        return self._collector.submit(gather)

    def _gather(self, prompts, responses, fields, chunks) -> list[float | None]:
        """On the collector thread: the server's rewards (while the workers run), then the weighted sums."""
        remote = self._remote.rewards(prompts, responses, fields) if self._remote is not None else None
        totals = []
        for i, row in enumerate(self._rows(len(prompts), chunks)):
            terms = [None if v is None else w * v for w, v in zip(self.weights, row)]
            terms += [remote[i]] if remote is not None else []
            totals.append(None if any(t is None for t in terms) else float(sum(terms)))
        return totals

    def _rows(self, n: int, chunks) -> list[list[float | None]]:
        """Each sample's rewards, one per function, from the workers' chunks."""
        rows, problems = [[] for _ in range(n)], []
        for start, stop, future in chunks:
            try:
                rows[start:stop], chunk_problems = future.result()
            except BrokenProcessPool as e:
                rows[start:stop] = [[None] * len(self.functions)] * (stop - start)
                chunk_problems = [f"the worker process scoring samples {start}..{stop - 1} died ({e})"]
            problems += chunk_problems
        if problems:
            log.warning("%d reward function call(s) could not score their sample; the first: %s", len(problems),
                        problems[0])
        return rows

    def close(self) -> None:
        """Finish the batches in flight, then stop the workers and the server's client."""
        self._collector.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._remote is not None:
            self._remote.close()
