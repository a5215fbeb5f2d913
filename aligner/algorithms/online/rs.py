"""`aligner train rs` (conf/rs.yaml): rejection sampling, NeMo-Aligner's online/rs.py, on the online-RL loop's
pieces (`online/rl.py`). `RSTrainer.train_step` is one step, top to bottom:

  prompts (the shared loop's stateful sampler, `rs.prompts_per_step` per step)
  -> generate: `rs.num_rollouts_per_prompt` samples per prompt with the in-process engine on the live
     weights (the RL loop's `generate`: prompts split over data-parallel replicas, sample k of the run
     seeded with (trainer.seed, k))
  -> score: reward functions and/or a reward or verifier server (`reward.*`, the RL loop's scorer)
  -> select: the `rs.top_n` best scored samples of each prompt (`rs_select.select_winners`: ties go to
     the earlier sample, an unscored sample never wins)
  -> SFT on the winners: next-token NLL on each kept response (and the eos or stop token that ended
     it), the prompt masked (`shared/sft.SFTObjective` through the sequence machinery), in
     optimizer steps of trainer.global_batch_size kept samples
  -> refit the engine (a no-op for the in-process engine), metrics, rollouts with their `kept` flag
     to <run_dir>/rollouts/step_<N>.jsonl; the shared loop then validates (greedy `val/reward/mean`,
     also before the first step), checkpoints and resumes (sampler position and RNG states).

Metrics: `reward/mean` and `reward/std` (every scored sample), `reward/kept_mean`, `fraction/accepted`
(kept / generated), `fraction/unscored`, `fraction/ended`, `response_length/mean` and
`response_length/kept_mean`, `loss` (token-mean NLL of the kept samples), `lr`, `grad_norm`,
`optimizer_steps`, `timing/<phase>_s`, `throughput/generated_tokens_per_s`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import time

import torch

from aligner.algorithms.shared.sft import SFTObjective
from aligner.algorithms.shared.sequence_trainer import attach, packing_enabled
from aligner.algorithms.online.samples import Sample, rollout_metrics
from aligner.algorithms.online.setup import build_online_run
from aligner.algorithms.online.rollouts import RolloutTrainer, Timings
from aligner.algorithms.online.rs_select import flat_winners
from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step
from aligner.config import load_resolved
from aligner.config.rl_schema import RLAlgorithmConfig
from aligner.runtime import distributed

SFT = SFTObjective()
ROLLOUT_KEYS = ("reward/mean", "reward/std", "response_length/mean", "fraction/ended", "fraction/unscored")


def kept_sft_loss(sums: torch.Tensor, counts: torch.Tensor, batch: dict):
    """SFT's loss (`SFTObjective.loss`) over the kept sequences of a micro-batch: `batch["keep"]` [n]
    is 1 for a kept sample, 0 for a filler (it neither trains nor counts in the token mean)."""
    keep = batch["keep"].to(sums.dtype)
    return SFT.loss(sums * keep, counts * keep, batch)


def selection_metrics(samples: list[Sample], kept: list[int]) -> dict:
    """The step's rollout metrics (every sample; reward over the scored ones) and the kept samples'."""
    metrics = {k: v for k, v in rollout_metrics(samples, 0, 1).items() if k in ROLLOUT_KEYS}
    chosen = [samples[i] for i in kept]
    metrics["fraction/accepted"] = len(kept) / len(samples)
    metrics["reward/kept_mean"] = statistics.fmean(s.score for s in chosen) if chosen else float("nan")
    metrics["response_length/kept_mean"] = (statistics.fmean(len(s.response_ids) for s in chosen) if chosen
                                            else float("nan"))
    return metrics


class RSTrainer(RolloutTrainer):
    """The online loop's generation, scoring, micro-batches, update loop, validation and refit check, with
    RS's step. `self.a` is the RL algorithm config RS amounts to: groups of `rs.num_rollouts_per_prompt`
    samples, rewards = scores (no over-long shaping), one pass."""

    def __init__(self, cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size: int, tokenizer, engine,
                 scorer, packing: dict, val_scorer=None):
        r = cfg.rs
        algorithm = RLAlgorithmConfig(num_generations=r.num_rollouts_per_prompt, prompts_per_step=r.prompts_per_step,
                                      log_rollouts=r.log_rollouts)
        super().__init__(cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size, tokenizer, engine,
                         scorer, packing, algorithm, val_scorer)
        self.rs = r
        self.loss_step = sequence_loss_step(kept_sft_loss, vocab_size)
        self.kept: list[int] = []  # the step's kept sample indices, for its rollouts file

    # ---- one step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        timings, start = Timings(), time.perf_counter()
        with timings("generate"):
            samples = self.generate(self.next_prompts())
        self.engine_sleeps()
        pending = self.submit_scores(samples)
        with timings("score_wait"):
            self.await_scores(samples, pending, timings)
        kept = flat_winners([s.score for s in samples], self.rs.num_rollouts_per_prompt, self.rs.top_n)
        with timings("train"):
            update = self.train_on(samples, kept)
        with timings("refit"):
            self.engine.refit()
            refit = self.refit_metrics()
        metrics = {**selection_metrics(samples, kept), **update, **refit}
        self.kept = kept
        return self.finish_step(metrics, timings, start, samples)

    def train_on(self, samples: list[Sample], kept: list[int]) -> dict:
        """SFT optimizer steps on the kept samples, trainer.global_batch_size at a time (the RL loop's
        `update` with `kept_sft_loss`). The batch is filled up to rs.prompts_per_step x rs.top_n with
        copies of generated samples weighted 0, so that every step has the same shape and every
        data-parallel rank the same micro-batches; an optimizer step of fillers only is skipped."""
        wanted = self.rs.prompts_per_step * self.rs.top_n
        batch = [dataclasses.replace(samples[i], valid=True) for i in kept]
        batch += [dataclasses.replace(s, valid=False) for s in samples[:wanted - len(batch)]]
        micro, length, mine = self.micro_batches(batch)
        attach(micro, "keep", [torch.tensor([float(s.valid) for s in group]) for group in self.groups_of(mine)])
        update = self.update(micro, length, batch)
        return {k: update[k] for k in ("loss", "lr", "grad_norm", "optimizer_steps")}

    def write_rollouts(self, samples: list[Sample]) -> None:
        """The first rs.log_rollouts samples with their score and whether they were kept (`valid`, as in
        the RL loop's rows: the sample is learned from)."""
        if not self.is_logger or not self.rs.log_rollouts:
            return
        path = self.run_dir / "rollouts" / f"step_{self.step + 1:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        shown, chosen, n = samples[:self.rs.log_rollouts], set(self.kept), self.rs.num_rollouts_per_prompt
        texts = self.tokenizer.batch_decode([s.response_ids for s in shown], skip_special_tokens=True)
        with open(path, "w") as f:
            for k, (sample, text) in enumerate(zip(shown, texts)):
                f.write(json.dumps({"prompt": sample.prompt.text, "response": text, "score": sample.score,
                                    "kept": k in chosen, "valid": k in chosen, "is_end": sample.is_end,
                                    "prompt_index": k // n, "sample": k % n}) + "\n")


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "rs"))


def run(cfg) -> None:
    """One rank of `aligner train rs` with a validated config."""
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    with contextlib.closing(build_online_run(cfg, packed, reference=False)) as online:
        RSTrainer(*online.trainer_args(cfg), online.scorer, packing=online.packing, val_scorer=online.val_scorer).fit()
    distributed.shutdown()
