"""What the actor uses to reach the reward, critic and verifier servers (plain `tritonclient.http`,
so the actor does not need PyTriton itself).

* Calls return `concurrent.futures.Future`s: scoring overlaps generation. The work runs on a small
  thread pool, one HTTP connection per thread; a batch larger than the server's `max_batch_size`
  goes out as several requests at once, which the server's dynamic batcher may merge.
* Results are typed per sample: `SampleResult(status="ok" | "error" | "timeout", value, message)`.
  `Scores.values` holds NaN where a sample was not scored and `Scores.scored` says which were: the
  loop masks unscored samples out; nothing is silently scored 0.
* Connection failures are retried `retries` times with exponential backoff: a refused connection
  (nothing was sent) always, a connection that dropped mid-request (geventhttpclient's
  `HTTPConnectionClosed`, which is neither a PyTriton nor a Triton exception, or a reset) only for
  idempotent endpoints, since the server may have acted on it (`critic_train` is not resent).
* A server's refusal (wrong dtype, too long, out-of-vocabulary ids, ...) is not retried: the
  samples get status "error" and the server's one-line reason. "Model not found / not ready"
  (a server still loading its models) is retried like a refused connection. A request that exceeds `timeout_s`
  gets status "timeout" (the server still finishes it).
* `wait_ready(timeout_s)` polls the model's readiness URL and raises `ServerUnavailable` naming
  host, port and endpoint.
* Each request asks the server to close its connection afterwards: an idle keep-alive connection
  would hold a stopping tritonserver until its exit timeout, after which it dies uncleanly and
  leaves its model directories in /tmp. On loopback this costs nothing measurable.
"""
from __future__ import annotations

import logging
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from aligner.errors import UserError
from aligner.runtime.optional import require
from aligner.servers import protocol

# tritonclient and geventhttpclient are imported inside the methods that call a server: they are optional
# (the `serve` extra), and `require` names the extra to install when they are missing.

log = logging.getLogger(__name__)

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
# Triton's answers while a model is not loaded (yet): the request did not run.
_NOT_SERVING_YET = ("is not found", "is not ready", "unavailable")
_KIND = {"reward_model": "reward", "verifier": "verifier", "critic_infer": "critic", "critic_train": "critic",
         "critic_save": "critic", "critic_load": "critic"}


class ServerUnavailable(UserError, ConnectionError):
    fix = "start the server or correct the URL"


class CallFailed(Exception):
    """A request got no result: `status` is "error" or "timeout"; the message says why."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class SampleResult:
    status: str  # ok | error | timeout
    value: np.ndarray | None = None  # this sample's output row(s) when ok
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


@dataclass(frozen=True)
class Scores:
    """Rewards of a batch, in input order. values [n, A] float32 (NaN where not scored)."""

    values: np.ndarray
    results: tuple[SampleResult, ...]

    @property
    def scored(self) -> np.ndarray:
        return np.array([r.ok for r in self.results], dtype=bool)

    @property
    def failures(self) -> dict[int, str]:
        return {i: f"{r.status}: {r.message}" for i, r in enumerate(self.results) if not r.ok}


def _server_reason(text: str) -> str:
    """The one line that says why: the exception our server raised, or Triton's own message."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception): ", ln) and "TritonModelException" not in ln]
    return raised[-1] if raised else (lines[0] if lines else text)


_TRITON_DTYPES = {"int64": "INT64", "int32": "INT32", "float32": "FP32", "float64": "FP64", "bool": "BOOL"}


def _triton_dtype(array: np.ndarray) -> str:
    return "BYTES" if array.dtype.kind in "OS" else _TRITON_DTYPES[array.dtype.name]


class EndpointClient:
    """One endpoint of one server: retries, failure classification, readiness. Thread-safe."""

    def __init__(self, host: str, port: int, model: str, *, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, idempotent: bool = True):
        self.host, self.port, self.model = host, port, model
        self.timeout_s, self.retries, self.backoff_s, self.idempotent = timeout_s, retries, backoff_s, idempotent
        self.kind = _KIND.get(model, model)
        self._local = threading.local()

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.where}/v2/models/{self.model}/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float = 60.0, poll_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"no {self.kind} server at {self.where} after {timeout_s:g} s (model "
                                        f"'{self.model}' not ready at http://{self.where}/v2/models/{self.model}/ready)")
            time.sleep(poll_s)

    def _connection(self):
        if getattr(self._local, "client", None) is None:
            require("tritonclient")
            import tritonclient.http as http  # optional (aligner[serve]), required just above

            self._local.client = http.InferenceServerClient(self.where, connection_timeout=min(self.timeout_s, 10.0),
                                                            network_timeout=self.timeout_s)
        return self._local.client

    def _drop_connection(self) -> None:
        client, self._local.client = getattr(self._local, "client", None), None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped anyway
                pass

    def call(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Send one request; the outputs by name. Raises CallFailed."""
        # optional (aligner[serve]; geventhttpclient comes with tritonclient); _connection required them
        import tritonclient.http as http
        from geventhttpclient.response import HTTPConnectionClosed
        from tritonclient.utils import InferenceServerException

        infer_inputs = []
        for name, array in inputs.items():
            tensor = http.InferInput(name, list(array.shape), _triton_dtype(array))
            tensor.set_data_from_numpy(array, binary_data=True)
            infer_inputs.append(tensor)
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                result = self._connection().infer(self.model, infer_inputs, headers={"Connection": "close"})
                response = result.get_response()
                return {o["name"]: result.as_numpy(o["name"]) for o in response.get("outputs", [])}
            except InferenceServerException as e:
                reason = _server_reason(e.message() or str(e))
                if "timed out" in reason.lower() or "deadline" in reason.lower():
                    raise CallFailed(TIMEOUT, reason) from None
                if not any(s in reason for s in _NOT_SERVING_YET):
                    raise CallFailed(ERROR, f"{self.model} at {self.where} refused the request: {reason}") from None
                last = e  # a (re)starting server: the model did not run, so resending is safe
            except TimeoutError:
                self._drop_connection()
                raise CallFailed(TIMEOUT, f"{self.model} at {self.where} gave no answer within {self.timeout_s:g} s") \
                    from None
            except ConnectionRefusedError as e:  # nothing was sent: always safe to retry
                self._drop_connection()
                last = e
            except (HTTPConnectionClosed, ConnectionError, OSError) as e:  # the server may have received it
                self._drop_connection()
                last = e
                if not self.idempotent:
                    raise CallFailed(ERROR, f"the connection to {self.model} at {self.where} dropped mid-request "
                                            f"({type(e).__name__}); not resent since it may have been applied") from None
            log.warning("%s at %s: %s (attempt %d of %d)", self.model, self.where, type(last).__name__, attempt + 1,
                        self.retries + 1)
        raise CallFailed(ERROR, f"no answer from {self.model} at {self.where} after {self.retries + 1} attempts "
                                f"({type(last).__name__}: {last})")


class _Gather:
    """Completes one Future once every chunk of a batch has its per-sample results."""

    def __init__(self, n: int, chunks: int, finish):
        self.results, self.future = [None] * n, Future()
        self._left, self._lock, self._finish = chunks, threading.Lock(), finish
        if chunks == 0:
            self.future.set_result(finish(self.results))

    def chunk_done(self, start: int, results: list[SampleResult]) -> None:
        self.results[start:start + len(results)] = results
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                self.future.set_result(self._finish(self.results))
            except Exception as e:  # noqa: BLE001 - surface it through the future
                self.future.set_exception(e)


class _PooledClient:
    def __init__(self, workers: int, name: str):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _rows_in_chunks(self, n: int, max_rows: int, run_chunk, finish) -> Future:
        starts = list(range(0, n, max_rows))
        gather = _Gather(n, len(starts), finish)
        for start in starts:
            stop = min(start + max_rows, n)

            def task(start=start, stop=stop):
                try:
                    results = run_chunk(start, stop)
                except CallFailed as e:
                    results = [SampleResult(e.status, None, e.message)] * (stop - start)
                except Exception as e:  # noqa: BLE001 - never lose samples to an unexpected error
                    results = [SampleResult(ERROR, None, f"{type(e).__name__}: {e}")] * (stop - start)
                gather.chunk_done(start, results)

            self.pool.submit(task)
        return gather.future


def _token_inputs(sequences, pad_to_multiple: int) -> dict[str, np.ndarray]:
    tokens, lengths = protocol.pad_token_rows([np.asarray(s, dtype=np.int64) for s in sequences], pad_to_multiple)
    return {"tokens": tokens, "sequence_lengths": lengths}


class RewardClient(_PooledClient):
    """Scores samples on a reward server (`reward_model`) or a verifier (`verifier`, with answers)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5555, model: str = "reward_model", *, max_rows: int = 64,
                 workers: int = 4, pad_to_multiple: int = 16, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5):
        super().__init__(workers, f"{model}-client")
        self.endpoint = EndpointClient(host, port, model, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        self.max_rows, self.pad_to_multiple = max_rows, pad_to_multiple

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self.endpoint.wait_ready(timeout_s)

    def score(self, sequences=None, *, texts: list[str] | None = None, answers: list[str] | None = None) -> Future:
        """Future[Scores] for token-id `sequences` (each a list of ids) or `texts`; `answers` for a verifier."""
        if (sequences is None) == (texts is None):
            raise ValueError("pass either token-id sequences or texts")
        items = list(sequences if sequences is not None else texts)
        if answers is not None and len(answers) != len(items):
            raise ValueError(f"{len(answers)} answers for {len(items)} samples")

        def run_chunk(start, stop):
            results = {i: SampleResult(ERROR, None, "the sample has no tokens") for i in range(start, stop)
                       if sequences is not None and len(items[i]) == 0}
            send = [i for i in range(start, stop) if i not in results]
            if not send:
                return [results[i] for i in range(start, stop)]
            if sequences is not None:
                inputs = _token_inputs([items[i] for i in send], self.pad_to_multiple)
            else:
                inputs = {"sentences": protocol.text_array([items[i] for i in send])}
            if answers is not None:
                inputs["answers"] = protocol.text_array([answers[i] for i in send])
            try:
                rewards = self.endpoint.call(inputs)["rewards"]
                if rewards.shape[0] != len(send) or not np.isfinite(rewards).all():
                    raise CallFailed(ERROR, f"the server returned {rewards.shape[0]} rows (non-finite: "
                                            f"{int((~np.isfinite(rewards)).sum())}) for {len(send)} samples")
                results.update((i, SampleResult(OK, row)) for i, row in zip(send, rewards.astype(np.float32)))
            except CallFailed as e:
                results.update((i, SampleResult(e.status, None, e.message)) for i in send)
            return [results[i] for i in range(start, stop)]

        def finish(results):
            width = next((r.value.shape[0] for r in results if r.ok), 1)
            values = np.full((len(results), width), np.nan, dtype=np.float32)
            for i, r in enumerate(results):
                if r.ok:
                    values[i] = r.value
            return Scores(values, tuple(results))

        return self._rows_in_chunks(len(items), self.max_rows, run_chunk, finish)


@dataclass(frozen=True)
class Values:
    """Per-token critic values of a batch, in input order: `results[i].value` has one value per
    token of sample i when ok. `seconds`: the server's time for the forwards, summed over the
    batch's requests that got an answer (requests the server merged into one call each count that
    call's time). `rewards`: the scores [n, A] of the reward model the critic service co-hosts, which
    critic_infer computes beside the values (NaN where a sample got no answer); None without one."""

    results: tuple[SampleResult, ...]
    seconds: float = 0.0
    rewards: np.ndarray | None = None

    @property
    def scored(self) -> np.ndarray:
        return np.array([r.ok for r in self.results], dtype=bool)

    def padded(self, width: int) -> np.ndarray:
        """[n, width] float32, NaN where a sample has no values."""
        out = np.full((len(self.results), width), np.nan, dtype=np.float32)
        for i, r in enumerate(self.results):
            if r.ok:
                out[i, :min(width, len(r.value))] = r.value[:width]
        return out


@dataclass(frozen=True)
class TrainResult:
    """critic_train's reply: the mean loss over the optimizer steps, the fraction of masked tokens
    whose value was clipped (over all the steps), and the server's seconds for the training."""

    loss_mean: float
    clip_fraction: float
    seconds: float


class CriticClient(_PooledClient):
    """critic_infer (futures of typed per-sample values), critic_train, critic_save / critic_load
    (checkpoints named by the actor's step; `save_timeout_s` bounds each, since writing a large critic
    takes far longer than a values request)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5567, *, max_rows: int = 64, workers: int = 4,
                 pad_to_multiple: int = 16, timeout_s: float = 60.0, train_timeout_s: float = 3600.0,
                 save_timeout_s: float = 3600.0, retries: int = 3, backoff_s: float = 0.5):
        super().__init__(workers, "critic-client")
        make = lambda name, timeout, idempotent: EndpointClient(  # noqa: E731
            host, port, name, timeout_s=timeout, retries=retries, backoff_s=backoff_s, idempotent=idempotent)
        self.infer_endpoint = make("critic_infer", timeout_s, True)
        self.train_endpoint = make("critic_train", train_timeout_s, protocol.CRITIC_TRAIN.idempotent)
        self.save_endpoint = make("critic_save", save_timeout_s, protocol.CRITIC_SAVE.idempotent)
        self.load_endpoint = make("critic_load", save_timeout_s, protocol.CRITIC_LOAD.idempotent)
        self.max_rows, self.pad_to_multiple = max_rows, pad_to_multiple

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for endpoint in (self.infer_endpoint, self.train_endpoint, self.save_endpoint, self.load_endpoint):
            endpoint.wait_ready(max(0.0, deadline - time.monotonic()))

    def values(self, sequences) -> Future:
        """Future[Values] for token-id sequences."""
        items = [np.asarray(s, dtype=np.int64) for s in sequences]
        seconds = []  # one entry per answered chunk (list.append is atomic)
        rewards = {}  # first row of an answered chunk -> its co-hosted reward model's scores

        def run_chunk(start, stop):
            if any(len(s) == 0 for s in items[start:stop]):
                raise CallFailed(ERROR, "a sample has no tokens")
            out = self.infer_endpoint.call(_token_inputs(items[start:stop], self.pad_to_multiple))
            values = out[protocol.VALUES.name]
            seconds.append(float(out[protocol.SECONDS.name].reshape(-1)[0]))
            if "rewards" in out:
                rewards[start] = out["rewards"].astype(np.float32)
            return [SampleResult(OK, values[i - start, :len(items[i])].astype(np.float32)) for i in range(start, stop)]

        def finish(results) -> Values:
            table = None
            if rewards:
                table = np.full((len(items), next(iter(rewards.values())).shape[1]), np.nan, dtype=np.float32)
                for start, chunk in rewards.items():
                    table[start:start + len(chunk)] = chunk
            return Values(tuple(results), float(sum(seconds)), table)

        return self._rows_in_chunks(len(items), self.max_rows, run_chunk, finish)

    def train(self, tokens: np.ndarray, returns: np.ndarray, prev_values: np.ndarray, mask: np.ndarray) -> Future:
        """Future[TrainResult] of the optimizer steps the server took on this batch. All arrays
        [B, S] (tokens int64, the rest float32). Raises CallFailed through the future."""
        inputs = {"tokens": np.ascontiguousarray(tokens, dtype=np.int64),
                  protocol.RETURNS.name: np.ascontiguousarray(returns, dtype=np.float32),
                  protocol.PREV_VALUES.name: np.ascontiguousarray(prev_values, dtype=np.float32),
                  protocol.MASK.name: np.ascontiguousarray(mask, dtype=np.float32)}

        def call():
            out = {k: float(v.reshape(-1)[0]) for k, v in self.train_endpoint.call(inputs).items()}
            return TrainResult(out[protocol.LOSS_MEAN.name], out[protocol.CLIP_FRACTION.name],
                               out[protocol.SECONDS.name])

        return self.pool.submit(call)

    def save(self, step: int) -> Future:
        """Future[int]: `step` (the actor's), once the critic's checkpoint for it is written."""
        return self.pool.submit(self._step_call, self.save_endpoint, step)

    def load(self, step: int) -> Future:
        """Future[int]: `step`, once the critic is back to its checkpoint for that actor step (every
        rank). Raises CallFailed through the future when none was saved; the message lists those that were."""
        return self.pool.submit(self._step_call, self.load_endpoint, step)

    @staticmethod
    def _step_call(endpoint: EndpointClient, step: int) -> int:
        out = endpoint.call({protocol.STEP.name: np.array([step], dtype=np.int64)})
        return int(out[protocol.STEP.name].reshape(-1)[0])
