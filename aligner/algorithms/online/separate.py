"""Rollouts from separate workers (`generation.placement=separate`) on a fixed lag schedule.

Version v is the policy after v training steps (version 0: the initial policy); steps count from 1. Step t
trains rollouts generated from version `rollout_version(t, k)` = max(0, t-1-k), k = `algorithm.async.max_lag`,
so `async/lag` = min(t-1, k): a deterministic schedule, not "whatever is ready". At the start of step t
(version t-1 is the live weights) the trainer sends version t-1 to the workers if an order still to be
issued needs it, orders every step up to t+k whose version exists, and waits only for step t's rollouts:
generation of the next k steps overlaps this step's training.

Prompts and per-sample seeds are drawn when a step is ordered, from the trainer's stateful sampler, so a
sample is the same whichever placement or lag generated it. A checkpoint records the sampler where the
last trained step left it; rollouts ordered beyond it are regenerated after a resume, identically (same
prompts, seeds and weights). Their weights, versions older than the live ones, are kept beside the
checkpoints for that (`<run_dir>/checkpoints/rollout_weights/version_<v>.safetensors`, written by global
rank 0 before the checkpoint that needs them; rank 0 holds up to k older weight sets in CPU memory).
"""
from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from aligner.algorithms.online.samples import Sample
from aligner.files import atomic_write
from aligner.generation import rng
from aligner.models.weight_stream import iter_hf_weights
from aligner.runtime import collectives


def rollout_version(step: int, max_lag: int) -> int:
    """The weights version whose rollouts step `step` (1-based) trains on."""
    return max(0, step - 1 - max_lag)


class SeparateRollouts:
    """Every trainer rank's side of the schedule; `workers` (generation/workers.py) on global rank 0 only."""

    def __init__(self, trainer, workers, max_lag: int):
        self.trainer, self.workers, self.k = trainer, workers, int(max_lag)
        self.issued = None  # the last step ordered (set at the first step, after any resume)
        self.sent = None  # the version the workers hold
        self.pending = deque()  # (step, its prompts, the sampler's state after drawing them)
        self.kept: dict[int, dict[str, torch.Tensor]] = {}  # rank 0, k >= 1: older versions a resume may need
        self.trained_sampler = None  # the sampler's state after the prompts of the last trained step
        self.worker_seconds = 0.0

    @property
    def weights_dir(self) -> Path:
        return self.trainer.run_dir / "checkpoints" / "rollout_weights"

    # ---- one step ------------------------------------------------------------------------------------------
    def samples(self, timings) -> list[Sample]:
        """Step `trainer.step + 1`'s samples, with their weights version; first orders what it may."""
        t, live = self.trainer, self.trainer.step
        step = live + 1
        if self.issued is None:
            self.issued = live
        upcoming = range(self.issued + 1, min(step + self.k, t.cfg.trainer.max_steps) + 1)
        for s in upcoming:
            version = rollout_version(s, self.k)
            if version != self.sent:
                with timings("broadcast"):
                    self._send(version, live)
            prompts = t.next_prompts()
            self.pending.append((s, prompts, t.sampler.state_dict()))
            if self.workers is not None:
                n, params = t.a.num_generations, t.params
                ids = [prompts[k // n].ids for k in range(len(prompts) * n)]
                seeds = [rng.derive_seed(params.seed, t.first_sample_id + k) for k in range(len(ids))]
                self.workers.order(s, version, ids, seeds, params)
            self.issued = s
        ordered, prompts, self.trained_sampler = self.pending.popleft()
        if ordered != step:
            raise RuntimeError(f"the rollout schedule is out of step: step {step} found step {ordered}'s order")
        with timings("generation_wait"):
            answer = self.workers.results(step) if self.workers is not None else None
        answer = collectives.broadcast_object(answer, src=0)
        n = t.a.num_generations
        self.worker_seconds = answer["busy_s"]
        return [Sample(prompts[k // n], r, lp, e, version=answer["version"])
                for k, (r, lp, e) in enumerate(zip(answer["responses"], answer["logprobs"], answer["is_end"]))]

    def metrics(self, step: int) -> dict:
        out = {"async/lag": float(step - 1 - rollout_version(step, self.k))}
        if self.workers is not None:
            out.update({f"async/worker_{w}_busy_fraction": busy for w, busy in sorted(self.workers.busy.items())})
        return collectives.broadcast_object(out, src=0)

    # ---- weights -------------------------------------------------------------------------------------------
    def _send(self, version: int, live: int) -> None:
        """Version `version` to the workers: the live weights (gathered by every rank: collective), or an older
        set rank 0 kept (after a resume)."""
        t = self.trainer
        if version == live:
            stream = iter_hf_weights(t.model, t.cfg.model, t.vocab_size)
            if self.workers is None:
                for _ in stream:  # the other ranks' part of the gathers
                    pass
            else:
                self.workers.send_weights(self._keeping(stream, version), version)
        elif self.workers is not None:
            if version not in self.kept:
                raise RuntimeError(f"weights version {version} is needed to regenerate rollouts after the resume, "
                                   f"but {self.weights_dir / f'version_{version}.safetensors'} is missing")
            self.workers.send_weights([self.kept[version]], version)
        self.sent = version

    def _keeping(self, stream, version: int):
        """`stream`, with a CPU copy of every bucket kept as `version` when a resume could need it (k >= 1)."""
        copy = {} if self.k else None
        for bucket in stream:
            if copy is not None:
                copy.update({name: tensor.detach().to("cpu", copy=True) for name, tensor in bucket.items()})
            yield bucket
        if copy is not None:
            self.kept[version] = copy

    def before_save(self, step: int) -> None:
        """Global rank 0, before the checkpoint of `step`: write the older versions a resume from it needs
        (step+1.. are generated from versions >= step-k), forget and delete the ones no step needs any more."""
        if self.workers is None:
            return
        needed = set(range(max(0, step - self.k), step))
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        for version in sorted(needed & set(self.kept)):
            path = self.weights_dir / f"version_{version}.safetensors"
            if not path.exists():
                with atomic_write(path, "wb") as f:
                    f.write(save(self.kept[version]))
        for version in [v for v in self.kept if v < step - self.k]:
            del self.kept[version]
        for path in self.weights_dir.glob("version_*.safetensors"):
            if int(path.stem.split("_")[1]) < step - self.k:
                path.unlink()

    def after_resume(self, step: int) -> None:
        """Global rank 0: the kept versions of the checkpoint of `step`, back in memory."""
        if self.workers is None or not self.weights_dir.exists():
            return
        for version in range(max(0, step - self.k), step):
            path = self.weights_dir / f"version_{version}.safetensors"
            if path.exists():
                self.kept[version] = load_file(path)

