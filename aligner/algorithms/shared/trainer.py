"""The shared trainer loop: global batch -> micro-batches -> one training step
(`training_step.forward_backward` + `optimizer_step`) -> validation, checkpoint cadence, automatic
resume, a clean stop on SIGUSR1 (runtime/preemption.py) and metrics.

An algorithm plugs in three things and the loop does not know which loss it optimises:
* a dataset (a sequence of samples),
* a `BatchFormat`: how long a sample is, how many tokens it trains on, how samples become tensors,
* a forward step (`aligner.models.forward_step`) whose loss returns `(loss_sum, count, report)`;
  every logged metric is `sum(report[key]) / sum(count)` over the global batch.
A trainer whose data changes during training (SPIN) renews it in `before_train_step`.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.algorithms.shared.training_step import forward_backward, forward_only, means, optimizer_step
from aligner.data.loader import GlobalBatchSampler, split_for_rank
from aligner.models import checkpoint
from aligner.errors import UserError
from aligner.observe.metrics import MetricsLog
from aligner.observe.progress import Progress
from aligner.observe.report import write_report
from aligner.runtime import collectives, preemption
from aligner.runtime.seeding import rng_state, set_rng_state

log = logging.getLogger(__name__)


class BatchFormat(Protocol):
    def length(self, sample) -> int:
        """Sequence length this sample needs (tokens fed to the model)."""

    def tokens(self, sample) -> int:
        """Tokens this sample contributes to a step (for throughput)."""

    def collate(self, samples: Sequence, length: int) -> dict:
        """Tensors of one micro-batch, every sequence padded to `length`."""


class Trainer:
    def __init__(self, cfg, model, optimizer, scheduler, forward_step, train_data, val_data, batch_format,
                 vocab_size: int, tokenizer=None, head: str = "lm", extra_meta: dict | None = None):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.forward_step, self.train_data, self.val_data = forward_step, train_data, val_data
        self.batch_format, self.vocab_size, self.tokenizer, self.head = batch_format, vocab_size, tokenizer, head
        self.extra_meta = extra_meta  # kept in each checkpoint's metadata (e.g. a reward head's attributes)
        self.run_dir = Path(cfg.run_dir)
        self.step = 0
        t = cfg.trainer
        self.sampler = GlobalBatchSampler(len(train_data), self.samples_per_step(), seed=t.seed,
                                          shuffle=cfg.data.shuffle)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        m = cfg.model
        # Sequence lengths must split into 2*CP chunks, and each chunk over TP under sequence parallel.
        self.length_multiple = 2 * m.context_parallel_size * (m.tensor_model_parallel_size if m.sequence_parallel else 1)
        self.is_logger = dist.get_rank() == 0

    # ---- what a subclass may change ---------------------------------------------------------------
    validate_at_start = False  # also validate once before the first step (logged as step 0)

    def samples_per_step(self) -> int:
        """Dataset samples a step draws from the sampler."""
        return self.cfg.trainer.global_batch_size

    def loop_state(self) -> dict:
        """What a subclass keeps in each checkpoint beyond the step, sampler and schedule."""
        return {}

    def load_loop_state(self, state: dict) -> None:
        """Restore `loop_state`'s dict at resume."""

    # ---- one optimizer step -------------------------------------------------------------------------
    def step_micro_batches(self, samples: list) -> tuple[list[dict], int]:
        """This DP rank's micro-batches of a step's samples, and their common sequence length."""
        mbs = self.cfg.trainer.micro_batch_size
        longest = max(self.batch_format.length(s) for s in samples)  # one length per step keeps PP shapes fixed
        length = -(-longest // self.length_multiple) * self.length_multiple
        mine = split_for_rank(samples, self.dp_rank, self.dp_size)
        return [self.batch_format.collate(mine[i:i + mbs], length) for i in range(0, len(mine), mbs)], length

    def before_train_step(self) -> dict:
        """A phase before each training step (SPIN generates its pairs here); returns metrics."""
        return {}

    def train_step(self) -> dict:
        start = time.perf_counter()
        samples = [self.train_data[i] for i in self.sampler.next_global_batch()]
        self.model.train()
        sums = forward_backward(self.model, self.optimizer, self.forward_step, *self.step_micro_batches(samples))
        grad_norm, lr = optimizer_step(self.optimizer, self.scheduler)
        elapsed = time.perf_counter() - start
        tokens = sum(self.batch_format.tokens(s) for s in samples)
        return {**means(sums), "lr": lr, "grad_norm": grad_norm, "loss_count": sums.get("count", 0.0),
                "consumed_samples": self.sampler.state_dict()["consumed_samples"],
                "timing/step_s": elapsed, "throughput/tokens_per_s": tokens / elapsed}

    @torch.no_grad()
    def validate(self) -> dict:
        t = self.cfg.trainer
        sampler = GlobalBatchSampler(len(self.val_data), min(t.global_batch_size, len(self.val_data)), seed=0,
                                     shuffle=False)
        self.model.eval()
        totals = {}
        for _ in range(t.val_batches):
            samples = [self.val_data[i] for i in sampler.next_global_batch()]
            for k, v in forward_only(self.model, self.forward_step, *self.step_micro_batches(samples)).items():
                totals[k] = totals.get(k, 0.0) + v
        return means(totals, prefix="val/")

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self) -> None:
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "loop": self.loop_state()}
        path = checkpoint.save_checkpoint(self.run_dir / "checkpoints" / f"step_{self.step:06d}", self.model,
                                          self.cfg.model, self.vocab_size, optimizer=self.optimizer,
                                          trainer_state=state, rank_state=rng_state(), tokenizer=self.tokenizer,
                                          head=self.head, extra_meta=self.extra_meta)
        if self.is_logger:
            log.info("saved checkpoint %s", path)
        self.write_report()

    def write_report(self) -> None:
        """`<run_dir>/report.html` (aligner report), refreshed at each checkpoint and at the end: tens of ms."""
        if not self.is_logger:
            return
        try:
            write_report([self.run_dir], self.run_dir / "report.html")
        except (UserError, OSError) as e:  # a report must never stop a run
            log.warning("report not written: %s", e)

    def resume(self) -> None:
        latest = checkpoint.latest_checkpoint(self.run_dir / "checkpoints")
        if latest is None:
            if self.cfg.model.pretrained:
                checkpoint.load_weights(self.cfg.model.pretrained, self.model)
                self.optimizer.reload_model_params()  # bf16: its fp32 main params still hold the initial weights
            return
        state, ranks = checkpoint.load_training_state(latest, self.model, self.optimizer)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.load_loop_state(state.get("loop", {}))
        if ranks is not None:
            set_rng_state(ranks)
        else:
            log.warning("%s was saved with a different world size; RNG streams restart from the seed", latest)
        if self.is_logger:
            log.info("resumed from %s at step %d", latest, self.step)

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> None:
        t = self.cfg.trainer
        self.resume()
        metrics_log = MetricsLog(self.run_dir, self.cfg, self.step) if self.is_logger else None
        progress = Progress(t.max_steps, self.step, self.cfg.logging.progress, silent=not self.is_logger,
                            desc="train")
        saved_at = self.step
        if self.validate_at_start and self.step == 0 and self.val_data is not None:
            start = self.validate()
            if metrics_log is not None:
                metrics_log.log(0, start)
        while self.step < t.max_steps:
            metrics = self.before_train_step()
            metrics.update(self.train_step())
            self.step += 1
            if self.val_data is not None and t.val_interval and self.step % t.val_interval == 0:
                metrics.update(self.validate())
            if metrics_log is not None and (self.step % t.log_interval == 0 or self.step == t.max_steps):
                metrics_log.log(self.step, metrics)
            progress.update(metrics)
            if t.save_interval and self.step % t.save_interval == 0:
                self.save()
                saved_at = self.step
            if self.step < t.max_steps and preemption.stop_agreed():
                if saved_at != self.step:
                    self.save()
                collectives.barrier()  # no rank exits (and gets its peers killed) before the checkpoint is complete
                preemption.shield_exit()
                self._close(progress, metrics_log)
                raise preemption.Preempted(self.step)
        if t.save_last and saved_at != self.step:
            self.save()
        self._close(progress, metrics_log)
        self.write_report()
        if self.is_logger:
            log.info("report: %s", self.run_dir / "report.html")

    @staticmethod
    def _close(progress, metrics_log) -> None:
        progress.close()
        if metrics_log is not None:
            metrics_log.close()
