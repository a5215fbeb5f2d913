"""What the reward, critic and verifier servers share: job start-up, turning requests into token
rows, the served reward's post-processing, and the rank-0-serves / others-follow structure."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from aligner.data.preference_rm import encode_for_reward
from aligner.data.tokenizer import load_tokenizer
from aligner.observe.logs import configure_logging
from aligner.runtime import distributed
from aligner.runtime.seeding import seed_everything
from aligner.servers.engine import STOP, Broadcaster, follow, on_device
from aligner.servers.protocol import RequestError, check_rows, check_tokens, decode_texts
from aligner.servers.triton import serve_bindings

log = logging.getLogger(__name__)

# Ranks other than 0 wait in a broadcast for the next request, however long the server idles.
COLLECTIVE_TIMEOUT_S = 30 * 24 * 3600


def init_job(cfg) -> None:
    """Process group (long collective timeout), model parallel state, threads, logging, seed."""
    distributed.init_process_group(timeout_s=COLLECTIVE_TIMEOUT_S)
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    distributed.init_model_parallel(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)
    configure_logging(torch.distributed.get_rank())
    seed_everything(cfg.trainer.seed if "trainer" in cfg else 0)


class Job:
    """Rank 0's side of a server job. Every collective step runs in `step(command, tensors)`: under
    one lock (endpoints share the weights and the ranks' collectives), on the job's device, after
    broadcasting the command to the other ranks. A step that fails while other ranks take part
    stops the server, since the ranks may no longer be in step; with one rank the error only fails
    that request."""

    def __init__(self):
        self.broadcaster, self.lock = Broadcaster(), threading.Lock()
        self.stop, self.failed = threading.Event(), threading.Event()

    @contextlib.contextmanager
    def step(self, command: int, tensors: dict | None = None):
        with self.lock, on_device():
            try:
                yield self.broadcaster.send(command, tensors)
            except BaseException:
                if torch.distributed.get_world_size() > 1:
                    log.error("a collective step failed: stopping the server, whose ranks may be out of step")
                    self.failed.set()
                    self.stop.set()
                raise

    def release(self) -> bool:
        """Tell the other ranks to stop; False when they are already gone."""
        with self.lock:
            try:
                self.broadcaster.send(STOP)
                return True
            except Exception as e:  # noqa: BLE001 - nothing left to release
                log.warning("could not release the other ranks: %s", e)
                return False


def run_job(cfg, job: Job | None, bindings_factory, handlers: dict) -> None:
    """Rank 0 (with its `job`) serves `bindings_factory()` until SIGTERM, then releases the other
    ranks, which run `handlers` for each broadcast command meanwhile. All then leave the process
    group; a rank whose handler fails exits at once, so that rank 0's collective fails too."""
    if torch.distributed.get_rank() == 0:
        try:
            serve_bindings(cfg.server, cfg.run_dir, bindings_factory(), stop=job.stop)
        finally:  # after a failed step the other ranks may wait in any collective: leave them to fail
            if not job.failed.is_set() and job.release():
                distributed.shutdown()
        if job.failed.is_set():
            raise RuntimeError("the server stopped after a collective step failed (see the log above)")
    else:
        # The launcher signals every rank at once; these ranks stop when rank 0 says so.
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        follow(Broadcaster(), handlers)
        distributed.shutdown()


def load_server_tokenizer(path, checkpoint=None):
    """The tokenizer for text requests: `path`, else `<checkpoint>/tokenizer`, else None."""
    if path:
        return load_tokenizer(path)
    if checkpoint and (Path(checkpoint) / "tokenizer").is_dir():
        return load_tokenizer(Path(checkpoint) / "tokenizer")
    return None


class RequestReader:
    """Requests of one merged call -> one padded token batch (validated), and the way back."""

    def __init__(self, max_rows: int, max_length: int, vocab_size: int, tokenizer=None):
        self.max_rows, self.max_length, self.vocab_size, self.tokenizer = max_rows, max_length, vocab_size, tokenizer

    def _rows(self, request) -> list[np.ndarray]:
        if "tokens" in request or "sequence_lengths" in request:
            tokens, lengths = check_tokens(request, max_rows=self.max_rows, max_length=self.max_length,
                                           vocab_size=self.vocab_size)
            return [row[:n] for row, n in zip(tokens, lengths)]
        if "sentences" in request:
            if self.tokenizer is None:
                raise RequestError("this server has no tokenizer, so it cannot score 'sentences'; send 'tokens' "
                                   "and 'sequence_lengths', or start it with tokenizer=DIR")
            rows = [np.array(encode_for_reward(self.tokenizer, t), dtype=np.int64)
                    for t in decode_texts(request, max_rows=self.max_rows)]
            longest = max(len(r) for r in rows)
            if longest > self.max_length:
                raise RequestError(f"a sentence is {longest} tokens long, more than this server's "
                                   f"max_seq_length={self.max_length}")
            return rows
        raise RequestError("send 'tokens' and 'sequence_lengths', or 'sentences'")

    def token_batch(self, requests) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """-> tokens [N, S], lengths [N], rows per request. A bad request fails the whole call with
        a message naming it (the dynamic batcher may have merged it with others)."""
        rows, counts = [], []
        for i, request in enumerate(requests):
            try:
                mine = self._rows(request)
            except RequestError as e:
                where = f"request {i + 1} of the {len(requests)} merged in this call: " if len(requests) > 1 else ""
                raise RequestError(f"{where}{e}") from None
            rows += mine
            counts.append(len(mine))
        check_rows(len(rows), self.max_rows)
        width = max(len(r) for r in rows)
        tokens = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        return tokens, np.array([len(r) for r in rows], dtype=np.int64), counts


def split_outputs(outputs: dict[str, np.ndarray], counts: list[int]) -> list[dict]:
    """Per-request slices of merged outputs."""
    result, start = [], 0
    for n in counts:
        result.append({k: v[start:start + n] for k, v in outputs.items()})
        start += n
    return result


class RewardOutput:
    """The served reward: raw head outputs [N, A] -> optionally weighted over attributes
    (sum_a w_a r_a, giving [N, 1]) -> optionally standardised ((r - mean) / std)."""

    def __init__(self, cfg, num_outputs: int):
        self.weights = None
        if cfg.attribute_weights is not None:
            if len(cfg.attribute_weights) != num_outputs:
                raise ValueError(f"reward.attribute_weights has {len(cfg.attribute_weights)} entries but the reward "
                                 f"model has {num_outputs} outputs")
            self.weights = np.asarray(cfg.attribute_weights, dtype=np.float32).reshape(-1, 1)
        self.standardize, self.mean, self.std = cfg.standardize, cfg.mean, cfg.std
        self.num_outputs = 1 if self.weights is not None else num_outputs

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        rewards = raw.astype(np.float32)
        if self.weights is not None:
            rewards = rewards @ self.weights
        if self.standardize:
            rewards = (rewards - self.mean) / self.std
        return rewards.astype(np.float32)


def max_length(cfg, model_cfg) -> int:
    return cfg.server.max_seq_length or model_cfg.seq_length


def as_tensors(**arrays) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
