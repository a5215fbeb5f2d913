"""`aligner train ppo` (conf/ppo.yaml): one rank of the PPO loop (`online/ppo_trainer.py`) with its parts, and
the critic service it talks to.

The service is `aligner serve critic` (the critic, trained by `critic_train`, co-hosting the reward model
of `reward.checkpoint`). With no `critic.url`, global rank 0 starts it as a child process group on free
loopback ports with its own ranks and layout (`critic.launcher`, `critic.parallel`), waits for it with a
deadline and stops it at the end, on error and on Ctrl-C; on resume it is started from the critic
checkpoint of the actor's step. With `critic.url` it connects to a running service (its `reward_model`
endpoint scores when `reward.checkpoint` names the model it co-hosts, `reward.url` a separate reward
server) and tells it to load that step. slurm/ppo.sbatch runs both sides as one heterogeneous job
(`aligner/algorithms/online/ppo_hetjob.py`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from aligner.algorithms.shared.sequence_trainer import packing_enabled
from aligner.algorithms.online.ppo_trainer import PPOTrainer
from aligner.algorithms.online.setup import build_online_run
from aligner.data.tokenizer import load_tokenizer
from aligner.config import load_resolved
from aligner.config.schema import OptimConfig
from aligner.models import checkpoint
from aligner.rewards.scoring import RewardScorer, resolve_reward_functions
from aligner.runtime import distributed
from aligner.servers.client import CriticClient, RewardClient
from aligner.servers.process import ServerProcess, free_port_block

log = logging.getLogger(__name__)
RETRY_BACKOFF_S = 0.5


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "ppo"))


def resume_step(run_dir) -> int:
    """The step of the actor's newest complete checkpoint (0 = a fresh run)."""
    latest = checkpoint.latest_checkpoint(Path(run_dir) / "checkpoints")
    return checkpoint.read_metadata(latest)["trainer_state"]["step"] if latest is not None else 0


def _host_port(url: str) -> tuple[str, int]:
    host, _, port = url.rpartition(":")
    return host, int(port)


def _retries(timeout_s: float) -> int:
    """Retries whose exponential backoff (RETRY_BACKOFF_S, doubling) spans `timeout_s`."""
    retries, waited = 0, 0.0
    while waited < timeout_s:
        waited += RETRY_BACKOFF_S * 2 ** retries
        retries += 1
    return retries


class Service:
    """Global rank 0's side of the critic (+ reward) service: requests as futures, results in the
    trainer's layout, and `ConnectionError` naming the service when it stops answering in time."""

    def __init__(self, critic_url: str, reward_url: str | None, timeout_s: float, save_timeout_s: float,
                 scorer: RewardScorer | None):
        host, port = _host_port(critic_url)
        retries = _retries(timeout_s)
        self.where, self.timeout_s, self.save_timeout_s, self.scorer = critic_url, timeout_s, save_timeout_s, scorer
        # rows as wide as the step's longest sequence, like the actor's own batches (the clients' default
        # multiple of 16 made the service's forwards 1.6x the tokens on 20-token rollouts)
        self.critic = CriticClient(host, port, pad_to_multiple=1, timeout_s=timeout_s, train_timeout_s=timeout_s,
                                   save_timeout_s=save_timeout_s, retries=retries, backoff_s=RETRY_BACKOFF_S)
        # the reward model the critic service co-hosts scores in the values reply (one forward, not two),
        # and through its reward_model endpoint when no values are asked for (validation)
        self.cohosted = reward_url == critic_url
        self.reward = None
        if reward_url is not None:
            rhost, rport = _host_port(reward_url)
            self.reward = RewardClient(rhost, rport, pad_to_multiple=1, timeout_s=timeout_s, retries=retries,
                                       backoff_s=RETRY_BACKOFF_S)

    def wait_ready(self, timeout_s: float) -> None:
        self.critic.wait_ready(timeout_s)
        if self.reward is not None:
            self.reward.wait_ready(timeout_s)

    def lost(self, what: str, error: BaseException | None = None, key: str = "timeout_s") -> ConnectionError:
        detail = f" ({type(error).__name__}: {error})" if error is not None else ""
        return ConnectionError(f"the critic service at {self.where} stopped answering: {what} within "
                               f"critic.{key}={getattr(self, key):g} s{detail}")

    def _result(self, future, what: str, key: str = "timeout_s"):
        try:
            return future.result(timeout=getattr(self, key))
        except Exception as e:  # noqa: BLE001 - a timeout, or the call's own failure after its retries
            raise self.lost(what, e, key) from None

    def submit(self, samples: list, tokenizer, values: bool = True) -> tuple:
        """(len(samples), then futures of the critic's values, the reward model's scores and the reward
        functions' scores, each None when not asked for)."""
        sequences = [s.sequence()[0] for s in samples]
        functions = None
        if self.scorer is not None:
            texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
            functions = self.scorer.submit([s.prompt.text for s in samples], texts, [s.prompt.fields for s in samples])
        scores = self.reward is not None and not (values and self.cohosted)
        return (len(samples), self.critic.values(sequences) if values else None,
                self.reward.score(sequences) if scores else None, functions)

    def await_values_and_scores(self, pending: list, samples: list) -> tuple[np.ndarray, list, float]:
        """(values [N, T] per response token, scores with None = unscored, the service's seconds) of the
        samples whose requests `pending` holds, in order. A chunk the service failed for is asked again
        (`answered`) until critic.timeout_s after the step's first failure; a sample still failing then is
        unscored; a service that is not ready is lost."""
        width = max(len(s.response_ids) for s in samples)
        values = np.zeros((len(samples), width), dtype=np.float32)
        scores, seconds, k, since = [], 0.0, 0, None
        for n, value_future, reward_future, function_future in pending:
            got = self._result(value_future, "no critic values") if value_future is not None else None
            rewards = self._result(reward_future, "no rewards") if reward_future is not None else None
            extra = self._result(function_future, "no reward-function scores") if function_future is not None else None
            if any(r is not None and not r.scored.all() for r in (got, rewards)):
                since = since or time.monotonic()  # one deadline for the step, however many chunks failed
                sequences = [s.sequence()[0] for s in samples[k:k + n]]
                if got is not None:
                    got = self.answered(got, lambda: self.critic.values(sequences), self.critic.infer_endpoint,
                                        "no critic values", since)
                if rewards is not None:
                    rewards = self.answered(rewards, lambda: self.reward.score(sequences), self.reward.endpoint,
                                            "no rewards", since)
            seconds += got.seconds if got is not None else 0.0
            for i in range(n):
                sample, score = samples[k + i], 0.0
                if got is not None:
                    result = got.results[i]
                    start, length = len(sample.prompt.ids) - 1, len(sample.response_ids)
                    if result.ok:
                        values[k + i, :length] = result.value[start:start + length]
                    else:
                        score = None
                if rewards is not None and score is not None:
                    score = float(rewards.values[i, 0]) if rewards.scored[i] else None
                elif got is not None and self.cohosted and score is not None:
                    if got.rewards is None:
                        raise RuntimeError(f"the critic service at {self.where} sent values without reward scores: "
                                           f"it hosts no reward model, but reward.checkpoint says it does")
                    score = float(got.rewards[i, 0])
                if extra is not None and score is not None:
                    score = score + extra[i] if extra[i] is not None else None
                scores.append(score)
            k += n
        return values, scores, seconds

    def answered(self, got, again, endpoint, what: str, since: float):
        """`got` (Values or Scores of one chunk) with the chunk asked again (`again()`: a new future) while
        some sample failed and critic.timeout_s has not passed since `since`: a request that failed while
        the service stalled is answered once it recovers, so a slow service costs time, not samples. The
        whole chunk is resent, the same request as the first, so its numbers are an undisturbed run's.
        A failure while `endpoint` is not ready is `lost` at once: the client has already retried such a
        request (refused, not serving yet, no answer) for critic.timeout_s."""
        pause = RETRY_BACKOFF_S
        while not got.scored.all():
            if not endpoint.is_ready():
                raise self.lost(f"{what}, not ready")
            left = since + self.timeout_s - time.monotonic()
            if left <= 0:
                return got  # its failing samples are masked
            log.warning("%s failed for %d of %d samples (%s); asking again", endpoint.model,
                        int((~got.scored).sum()), len(got.results), next(r.message for r in got.results if not r.ok))
            time.sleep(min(pause, left))
            pause *= 2
            got = self._result(again(), what)
        return got

    def train_result(self, future) -> dict:
        reply = self._result(future, "no critic_train reply")
        return {"value/loss": float(reply.loss_mean), "value/clip_fraction": float(reply.clip_fraction),
                "timing/critic_train_server_s": float(reply.seconds)}

    def save(self, step: int) -> None:
        self._result(self.critic.save(step), f"the critic checkpoint of step {step} was not saved", "save_timeout_s")

    def load(self, step: int) -> None:
        self._result(self.critic.load(step), f"the critic checkpoint of step {step} was not loaded", "save_timeout_s")

    def close(self) -> None:
        self.critic.close()
        if self.reward is not None:
            self.reward.close()
        if self.scorer is not None:
            self.scorer.close()


def embedded_overrides(cfg, step: int) -> list[str]:
    """`aligner serve critic` overrides for the service this run starts (run_dir, port and host are
    ServerProcess's)."""
    c = cfg.critic
    out = [f"checkpoint={c.checkpoint or cfg.reward.checkpoint}", f"tokenizer={cfg.tokenizer.path}",
           f"launcher.nproc_per_node={c.launcher.nproc_per_node}",
           f"launcher.threads_per_rank={c.launcher.threads_per_rank}",
           f"server.max_seq_length={cfg.model.seq_length}",
           # inference rows per forward pass as many as a training micro-batch (less memory than training them)
           f"server.forward_micro_batch_size={c.trainer.micro_batch_size}"]
    if cfg.reward.checkpoint:
        out.append(f"reward_checkpoint={cfg.reward.checkpoint}")
    if step:
        out.append(f"resume_step={step}")
    for group, keys in (("parallel", ("tensor_model_parallel_size", "pipeline_model_parallel_size")),
                        ("trainer", ("global_batch_size", "micro_batch_size", "epochs", "max_steps", "loss_clip",
                                     "seed")),
                        # every optimizer key but decay_steps, which follows the service's own trainer.max_steps
                        ("optim", tuple(f.name for f in dataclasses.fields(OptimConfig) if f.name != "decay_steps"))):
        out += [f"{group}.{k}={c[group][k]}" for k in keys]
    out += [f"lora.rank={c.lora.rank}", f"lora.alpha={c.lora.alpha}", f"lora.dropout={c.lora.dropout}",
            f"lora.target_modules=[{','.join(c.lora.target_modules)}]"]
    return out


@contextlib.contextmanager
def critic_service(cfg, step: int):
    """Global rank 0: the connected `Service` (starting the embedded one first when critic.url is unset);
    stopped and closed on the way out, however the run ends."""
    c, r = cfg.critic, cfg.reward
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    functions = resolve_reward_functions(list(r.functions))
    scorer = RewardScorer(functions, list(r.weights) if r.weights is not None else None, workers=r.workers,
                          tokenizer=tokenizer) if functions else None
    server = None
    try:
        if c.url is None:
            run_dir = Path(cfg.run_dir) / "critic"
            if step == 0:
                _set_aside_stale(run_dir / "checkpoints")
            server = ServerProcess("critic", embedded_overrides(cfg, step), run_dir, port=free_port_block())
            started = time.monotonic()
            server.start().wait_ready(c.startup_timeout_s)
            log.info("critic service ready at %s:%d in %.1f s (log: %s)", server.host, server.port,
                     time.monotonic() - started, server.log_path)
            url = f"{server.host}:{server.port}"
            reward_url = r.url or (url if r.checkpoint else None)
        else:  # reward.checkpoint: the reward model that service co-hosts scores
            url, reward_url = c.url, r.url or (c.url if r.checkpoint else None)
        service = Service(url, reward_url, c.timeout_s, c.save_timeout_s, scorer)
        try:
            service.wait_ready(c.startup_timeout_s)
            if c.url is not None and step:
                service.load(step)
            yield service
        finally:
            service.close()
    finally:
        if server is not None:
            server.stop()


def _set_aside_stale(checkpoints: Path) -> None:
    """A fresh actor run must not meet critic checkpoints of an earlier attempt (a crash between the
    critic's save and the actor's): move them aside, never delete them."""
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        aside = checkpoints.with_name(f"checkpoints.stale.{int(time.time())}")
        checkpoints.rename(aside)
        log.warning("no actor checkpoint, so the critic starts fresh: moved %s to %s", checkpoints, aside)


def run(cfg) -> None:
    """One rank of `aligner train ppo` with a validated config."""
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    step = resume_step(cfg.run_dir)
    with contextlib.ExitStack() as stack:
        service = stack.enter_context(critic_service(cfg, step)) if dist.get_rank() == 0 else None
        # the critic service's reward replaces reward.functions' scorer (module doc)
        online = stack.enter_context(contextlib.closing(
            build_online_run(cfg, packed, reference=cfg.algorithm.kl.mode != "none", score=False)))
        PPOTrainer(*online.trainer_args(cfg), service, online.reference, packing=online.packing,
                   val_scorer=online.val_scorer, workers=online.workers).fit()
    distributed.shutdown()
