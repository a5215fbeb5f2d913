"""The shared trainer loop: global batch -> micro-batches -> megatron schedule -> optimizer step,
with validation, checkpoint cadence, automatic resume, a clean stop on SIGUSR1 (runtime/preemption.py)
and metrics.

An algorithm plugs in three things and the loop does not know which loss it optimises:
* a dataset (a sequence of samples),
* a `BatchFormat`: how long a sample is, how many tokens it trains on, how samples become tensors,
* a megatron forward step whose loss function returns `(loss_sum, count, report)`, where `count`
  is the normaliser (loss tokens for SFT, pairs for DPO) and `report` holds per-micro-batch sums.
  The loss is divided by the global count (`calculate_per_token_loss`), and every logged metric is
  `sum(report[key]) / sum(count)` over the global batch, so neither depends on the DP split.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from aligner.models import checkpoint
from aligner.observe.metrics import MetricsLog, Progress
from aligner.runtime import preemption
from aligner.runtime.seeding import rng_state, set_rng_state

log = logging.getLogger(__name__)


class BatchFormat(Protocol):
    def length(self, sample) -> int:
        """Sequence length this sample needs (tokens fed to the model)."""

    def tokens(self, sample) -> int:
        """Tokens this sample contributes to a step (for throughput)."""

    def collate(self, samples: Sequence, length: int) -> dict:
        """Tensors of one micro-batch, every sequence padded to `length`."""


def _sum_reports(reports: list[dict]) -> dict:
    """Sum micro-batch reports over this rank, then over data- and context-parallel ranks, then
    share the result from the last pipeline stage with every stage."""
    from megatron.core import parallel_state as ps

    sums = {}
    if ps.is_pipeline_last_stage():
        keys = sorted(reports[0]) if reports else []
        vector = torch.stack([sum(r[k] for r in reports) for k in keys]) if keys else torch.zeros(0)
        dist.all_reduce(vector, group=ps.get_data_parallel_group(with_context_parallel=True))
        sums = dict(zip(keys, vector.tolist()))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [sums]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        sums = box[0]
    return sums


def run_schedule(model, forward_step, micro_batches: list[dict], seq_length: int, forward_only: bool) -> dict:
    """Forward (+ backward) over this rank's micro-batches with megatron's schedule for the
    current pipeline layout (1F1B when PP > 1); returns the globally summed reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=seq_length,
        micro_batch_size=micro_batches[0]["tokens"].shape[0], forward_only=forward_only)
    return _sum_reports(reports)


class Trainer:
    def __init__(self, cfg, model, optimizer, scheduler, forward_step, train_data, val_data, batch_format,
                 vocab_size: int, tokenizer=None, head: str = "lm", extra_meta: dict | None = None):
        from megatron.core import parallel_state as ps

        from aligner.data.loader import GlobalBatchSampler

        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.forward_step, self.train_data, self.val_data = forward_step, train_data, val_data
        self.batch_format, self.vocab_size, self.tokenizer, self.head = batch_format, vocab_size, tokenizer, head
        self.extra_meta = extra_meta  # kept in each checkpoint's metadata (e.g. a reward head's attributes)
        self.run_dir = Path(cfg.run_dir)
        self.step = 0
        t = cfg.trainer
        self.sampler = GlobalBatchSampler(len(train_data), t.global_batch_size, seed=t.seed, shuffle=cfg.data.shuffle)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        m = cfg.model
        # Sequence lengths must split into 2*CP chunks, and each chunk over TP under sequence parallel.
        self.length_multiple = 2 * m.context_parallel_size * (m.tensor_model_parallel_size if m.sequence_parallel else 1)
        self.is_logger = dist.get_rank() == 0

    # ---- one optimizer step -------------------------------------------------------------------
    def _run_schedule(self, samples, forward_only: bool) -> dict:
        from aligner.data.loader import split_for_rank

        mbs = self.cfg.trainer.micro_batch_size
        longest = max(self.batch_format.length(s) for s in samples)  # one length per step keeps PP shapes fixed
        length = -(-longest // self.length_multiple) * self.length_multiple
        mine = split_for_rank(samples, self.dp_rank, self.dp_size)
        micro = [self.batch_format.collate(mine[i:i + mbs], length) for i in range(0, len(mine), mbs)]
        return run_schedule(self.model, self.forward_step, micro, length, forward_only)

    @staticmethod
    def _means(sums: dict, prefix: str = "") -> dict:
        count = max(sums.get("count", 0.0), 1.0)
        return {prefix + k: v / count for k, v in sums.items() if k != "count"}

    def train_step(self) -> dict:
        start = time.perf_counter()
        samples = [self.train_data[i] for i in self.sampler.next_global_batch()]
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums = self._run_schedule(samples, forward_only=False)
        # Advance the schedule first: optimizer step k (1-based) uses the LR of step k, so warm-up
        # never spends a step at LR 0.
        self.scheduler.step(increment=1)
        _, grad_norm, _ = self.optimizer.step()
        elapsed = time.perf_counter() - start
        tokens = sum(self.batch_format.tokens(s) for s in samples)
        return {**self._means(sums), "lr": self.optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norm if grad_norm is not None else float("nan"), "loss_count": sums.get("count", 0.0),
                "consumed_samples": self.sampler.state_dict()["consumed_samples"],
                "timing/step_s": elapsed, "throughput/tokens_per_s": tokens / elapsed}

    @torch.no_grad()
    def validate(self) -> dict:
        from aligner.data.loader import GlobalBatchSampler

        t = self.cfg.trainer
        sampler = GlobalBatchSampler(len(self.val_data), min(t.global_batch_size, len(self.val_data)), seed=0,
                                     shuffle=False)
        self.model.eval()
        totals = {}
        for _ in range(t.val_batches):
            samples = [self.val_data[i] for i in sampler.next_global_batch()]
            for k, v in self._run_schedule(samples, forward_only=True).items():
                totals[k] = totals.get(k, 0.0) + v
        return self._means(totals, prefix="val/")

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self) -> None:
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict()}
        path = checkpoint.save_checkpoint(self.run_dir / "checkpoints" / f"step_{self.step:06d}", self.model,
                                          self.cfg.model, self.vocab_size, optimizer=self.optimizer,
                                          trainer_state=state, rank_state=rng_state(), tokenizer=self.tokenizer,
                                          head=self.head, extra_meta=self.extra_meta)
        if self.is_logger:
            log.info("saved checkpoint %s", path)

    def resume(self) -> None:
        latest = checkpoint.latest_checkpoint(self.run_dir / "checkpoints")
        if latest is None:
            if self.cfg.model.pretrained:
                checkpoint.load_weights(self.cfg.model.pretrained, self.model)
            return
        state, ranks = checkpoint.load_training_state(latest, self.model, self.optimizer)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
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
        metrics_log = MetricsLog(self.run_dir, self.cfg.logging.tensorboard, self.step) if self.is_logger else None
        progress = Progress(t.max_steps, self.step, self.is_logger and self.cfg.logging.progress)
        saved_at = self.step
        while self.step < t.max_steps:
            metrics = self.train_step()
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
                dist.barrier()  # no rank exits (and gets its peers killed) before the checkpoint is complete
                preemption.shield_exit()
                self._close(progress, metrics_log)
                raise preemption.Preempted(self.step)
        if t.save_last and saved_at != self.step:
            self.save()
        self._close(progress, metrics_log)

    @staticmethod
    def _close(progress, metrics_log) -> None:
        progress.close()
        if metrics_log is not None:
            metrics_log.close()
