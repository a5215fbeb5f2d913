"""The online-RL loop (`aligner train grpo`, `aligner train reinforce`): the RL step without a
critic (README, "Online RL"). `RLTrainer.train_step` is one step, top to bottom:

  prompts (the shared loop's stateful sampler, `algorithm.prompts_per_step` per step)
  -> generate: `num_generations` samples per prompt with the in-process engine on the live weights,
     prompts split over data-parallel replicas (each context-parallel rank one more), sample k of the run
     seeded with (trainer.seed, k)
  -> score: the reward functions run in their pool (a future) while the trainer computes
  -> old and reference per-token log-probs (forward only; the old ones only when a step makes more
     than one update or the KL goes into the reward, else the first update's own forward gives them)
  -> rewards (+ over-long penalty, - KL under kl.mode=reward) -> group advantages over the whole step
     (dynamic sampling: groups whose rewards are all equal are dropped and replaced first)
  -> updates: ppo_epochs x minibatches of trainer.global_batch_size samples, each one optimizer step
  -> refit the engine (a no-op for the in-process engine: it reads the live parameters)
  -> metrics (README, "What a run shows"), a few rollouts to <run_dir>/rollouts/step_<N>.jsonl; the shared loop
     then validates (greedy `val/reward/mean`, also once before the first step) and checkpoints.
Every rank holds the step's whole list of samples (each replica generates its share, then they are
gathered), so advantages are global; each data-parallel rank trains its slice of every minibatch (its CP
ranks split each sequence, and see whole responses' values: `loss.response_values`).
"""
from __future__ import annotations

import json
import time

import torch
from megatron.core import parallel_state as ps

from aligner.algorithms.online import samples as rl_samples
from aligner.algorithms.online.loss import (PolicyLoss, logprobs_output, set_advantages_and_validity,
                                           token_logprob_values, token_values)
from aligner.algorithms.online.maths import kl_penalty
from aligner.algorithms.online.rollouts import RolloutTrainer, Timings
from aligner.algorithms.online.samples import Sample
from aligner.algorithms.shared.sequence_logprobs import collected
from aligner.algorithms.shared.sequence_trainer import attach
from aligner.models.forward_step import collect, make_forward_step
from aligner.runtime import collectives


class RLTrainer(RolloutTrainer):
    def __init__(self, cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size: int, tokenizer, engine,
                 scorer, reference, packing: dict, val_scorer=None, workers=None):
        """As `RolloutTrainer`, with reference: an `algorithms.shared.reference.Reference`, or None without
        a KL term."""
        super().__init__(cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size, tokenizer, engine,
                         scorer, packing, cfg.algorithm, val_scorer, workers)
        a, self.reference = self.a, reference
        values = token_values(vocab_size, self.params, entropy_grad=bool(a.entropy_coef))
        self.loss_step = make_forward_step(values, PolicyLoss(a, self.params.max_new_tokens))
        self.logprob_step = make_forward_step(token_logprob_values(vocab_size, self.params), collect(logprobs_output))
        # The reference scores under its whole tempered distribution: truncated by top-k/top-p it would give a
        # token the policy learned to sample, outside the reference's own top-k, probability 0 (infinite KL).
        full = self.params.replace(top_k=0, top_p=1.0)
        self.reference_step = self.logprob_step if full == self.params else \
            make_forward_step(token_logprob_values(vocab_size, full), collect(logprobs_output))
        updates = a.ppo_epochs * a.prompts_per_step * a.num_generations // cfg.trainer.global_batch_size
        self.needs_old_logprobs = updates > 1 or (reference is not None and a.kl.mode == "reward")
        self.kl_coef = a.kl.coef

    def loop_state(self) -> dict:
        return {**super().loop_state(), "kl_coef": self.kl_coef}

    def load_loop_state(self, state: dict) -> None:
        super().load_loop_state(state)
        self.kl_coef = state.get("kl_coef", self.kl_coef)

    # ---- one step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        timings, start = Timings(), time.perf_counter()
        samples, pending, dropped, seen = self.rollouts(timings)
        self.engine_sleeps()
        micro, length, mine = self.micro_batches(samples)
        self.logprob_passes(micro, length, timings)
        if not self.a.dynamic_sampling.enabled:  # the scores were computed while the log-probs were
            with timings("score_wait"):
                self.await_scores(samples, pending, timings)
        if self.reference is not None and self.a.kl.mode == "reward":
            rl_samples.subtract_kl(samples, self.sample_kl(micro, mine, samples), self.kl_coef)
        rl_samples.set_advantages(samples, self.a)
        for batch, group in zip(micro, self.groups_of(mine)):
            set_advantages_and_validity(batch, group)
        with timings("train"):
            update = self.update(micro, length, samples)
        with timings("refit"):
            if self.separate is None:  # separate workers get the new weights when the schedule needs them
                self.engine.refit()
            refit = self.refit_metrics()
        metrics = {**rl_samples.rollout_metrics(samples, dropped, seen), **update, **refit}
        return self.finish_step(metrics, timings, start, samples)

    # ---- generation and scoring -----------------------------------------------------------------------
    def rollouts(self, timings: Timings):
        """(the step's samples, their pending scores or None, dropped groups, groups seen). Without
        dynamic sampling the scores are left pending, to be awaited after the log-prob passes."""
        a = self.a
        samples = self.step_samples(timings)
        pending = self.submit_scores(samples)
        if not a.dynamic_sampling.enabled:
            return samples, pending, 0, a.prompts_per_step
        kept, dropped = [], []
        for refill in range(a.dynamic_sampling.max_refills + 1):
            if refill:
                with timings("generate"):
                    samples = self.generate(self.next_prompts())
                pending = self.submit_scores(samples)
            with timings("score_wait"):
                self.await_scores(samples, pending, timings)
            for group in rl_samples.groups_of(samples, a.num_generations):
                (kept if rl_samples.informative(group) else dropped).append(group)
            if len(kept) >= a.prompts_per_step:
                break
        return (rl_samples.choose_groups(kept, dropped, a.prompts_per_step), None, len(dropped),
                len(kept) + len(dropped))

    # ---- log-probs and updates ------------------------------------------------------------------------
    def logprob_passes(self, micro: list[dict], length: int, timings: Timings) -> None:
        """The forward-only passes before the advantages: the rollout policy's log-probs where needed, and
        the reference's under a KL term (`old_logprobs`, `ref_logprobs` of each micro-batch)."""
        with timings("logprobs"):
            self.attach_old_logprobs(micro, length)
        with timings("reference"):
            if self.reference is not None:
                attach(micro, "ref_logprobs", self.reference_logprobs(micro, length))

    def attach_old_logprobs(self, micro: list[dict], length: int) -> None:
        """The rollout policy's log-probs as each micro-batch's `old_logprobs`, where the ratio or the KL in
        the reward needs them: the trainer's forward (`algorithm.old_logprobs=trainer`), or the engine's
        own from sampling (`engine`, as TRL's PPO: one policy forward less, at the price of the engine's
        numerical mismatch, which the mismatch/* metrics report)."""
        if self.a.old_logprobs == "engine":
            attach(micro, "old_logprobs", [batch["engine_logprobs"] for batch in micro])
        elif self.needs_old_logprobs:
            attach(micro, "old_logprobs", self.token_logprobs(self.model, micro, length))

    def token_logprobs(self, model, micro: list[dict], length: int) -> list[torch.Tensor]:
        """Per-response-token log-probs [n, T] of each micro-batch (last pipeline stage; [] elsewhere)."""
        return collected(model, self.logprob_step, micro, length)

    def reference_logprobs(self, micro: list[dict], length: int) -> list[torch.Tensor]:
        """`token_logprobs` of the reference model, under its whole tempered distribution."""
        return self.reference.run(lambda model: collected(model, self.reference_step, micro, length))

    def sample_kl(self, micro: list[dict], mine: list[Sample], samples: list[Sample]) -> list[float]:
        """Each sample's masked-mean token KL(old policy || reference), shared by every rank."""
        kl = torch.zeros(len(samples))
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
                ps.get_context_parallel_rank() == 0:  # CP ranks hold the same whole rows (loss.response_values)
            per_sample = []
            for batch in micro:
                mask = batch["response_mask"]
                values = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], str(self.a.kl.estimator))
                per_sample += ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
            where = {id(s): i for i, s in enumerate(samples)}
            for sample, value in zip(mine, per_sample):
                kl[where[id(sample)]] = value
        return collectives.all_reduce(kl).tolist()

    # ---- validation and rollouts ---------------------------------------------------------------------
    def write_rollouts(self, samples: list[Sample]) -> None:
        if not self.is_logger or not self.a.log_rollouts:
            return
        path = self.run_dir / "rollouts" / f"step_{self.step + 1:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        shown = samples[:self.a.log_rollouts]
        texts = self.tokenizer.batch_decode([s.response_ids for s in shown], skip_special_tokens=True)
        with open(path, "w") as f:
            for sample, text in zip(shown, texts):
                row = {"prompt": sample.prompt.text, "response": text, "score": sample.score, "reward": sample.reward,
                       "advantage": sample.advantage, "valid": sample.valid, "is_end": sample.is_end,
                       "version": sample.version}
                if sample.episode is not None:  # a multi-turn episode: its turns as text, and how it ended
                    row.update(turns=sample.episode.transcript, end=sample.episode.end, error=sample.episode.error)
                f.write(json.dumps(row) + "\n")
