"""The online-RL loop (`aligner train grpo`, `aligner train reinforce`): DESIGN.md section 3 without the
critic. `RLTrainer.train_step` is one step, top to bottom:

  prompts (the shared loop's stateful sampler, `algorithm.prompts_per_step` per step)
  -> generate: `num_generations` samples per prompt with the in-process engine on the live weights,
     prompts split over data-parallel replicas, sample k of the run seeded with (trainer.seed, k)
  -> score: the reward functions run in their pool (a future) while the trainer computes
  -> old and reference per-token log-probs (forward only; the old ones only when a step makes more
     than one update or the KL goes into the reward, else the first update's own forward gives them)
  -> rewards (+ over-long penalty, - KL under kl.mode=reward) -> group advantages over the whole step
     (dynamic sampling: groups whose rewards are all equal are dropped and replaced first)
  -> updates: ppo_epochs x minibatches of trainer.global_batch_size samples, each one optimizer step
  -> refit the engine (a no-op for the in-process engine: it reads the live parameters)
  -> metrics (DESIGN section 4), a few rollouts to <run_dir>/rollouts/step_<N>.jsonl; the shared loop
     then validates (greedy `val/reward/mean`, also once before the first step) and checkpoints.
Every rank holds the step's whole list of samples (each replica generates its share, then they are
gathered), so advantages are global; each data-parallel rank trains its slice of every minibatch.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict

import torch
from megatron.core import parallel_state as ps

from aligner.algorithms import rl_samples
from aligner.algorithms.functional import kl_penalty
from aligner.algorithms.preference_trainer import attach
from aligner.algorithms.rl_loss import (PolicyLoss, logprobs_output, rl_micro_batches, token_logprob_values,
                                       token_values)
from aligner.algorithms.rl_samples import Sample
from aligner.algorithms.sequence_logprobs import collected
from aligner.algorithms.trainer import Trainer
from aligner.algorithms.training_step import forward_backward, optimizer_step
from aligner.data.loader import split_for_rank
from aligner.generation import rng
from aligner.generation.types import SamplingParams
from aligner.models.forward_step import collect, make_forward_step
from aligner.runtime import collectives


class Timings(defaultdict):
    """Seconds per phase of a step: `with timings("generate"): ...` adds to timings["generate"]."""

    def __init__(self):
        super().__init__(float)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self[phase] += time.perf_counter() - start


class RLTrainer(Trainer):
    validate_at_start = True

    def __init__(self, cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size: int, tokenizer, engine,
                 scorer, reference, packing: dict, val_scorer=None):
        """prompts: `aligner.data.prompts.Prompt`s; scorer: a `RewardScorer` on global rank 0, None
        elsewhere; reference: an `algorithms.reference.Reference`, or None without a KL term;
        val_scorer: a `RewardScorer` of `reward.val_functions` (rank 0), scored on validation only."""
        super().__init__(cfg, model, optimizer, scheduler, None, prompts, val_prompts, None, vocab_size, tokenizer)
        a, s = cfg.algorithm, cfg.sampling
        self.a, self.engine, self.scorer, self.reference, self.packing = a, engine, scorer, reference, packing
        self.val_scorer = val_scorer
        self.params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                     max_new_tokens=s.max_new_tokens, stop_strings=tuple(s.stop_strings),
                                     seed=cfg.trainer.seed)
        values = token_values(vocab_size, self.params, entropy_grad=bool(a.entropy_coef))
        self.loss_step = make_forward_step(values, PolicyLoss(a, s.max_new_tokens))
        self.logprob_step = make_forward_step(token_logprob_values(vocab_size, self.params), collect(logprobs_output))
        # The reference scores under its whole tempered distribution: truncated by top-k/top-p it would give a
        # token the policy learned to sample, outside the reference's own top-k, probability 0 (infinite KL).
        full = self.params.replace(top_k=0, top_p=1.0)
        self.reference_step = self.logprob_step if full == self.params else \
            make_forward_step(token_logprob_values(vocab_size, full), collect(logprobs_output))
        updates = a.ppo_epochs * a.prompts_per_step * a.num_generations // cfg.trainer.global_batch_size
        self.needs_old_logprobs = updates > 1 or (reference is not None and a.kl.mode == "reward")
        self.kl_coef = a.kl.coef
        self.first_sample_id = 0  # seed index of the first sample of the prompts just drawn

    def samples_per_step(self) -> int:
        return self.cfg.algorithm.prompts_per_step

    def loop_state(self) -> dict:
        return {"kl_coef": self.kl_coef}

    def load_loop_state(self, state: dict) -> None:
        self.kl_coef = state.get("kl_coef", self.kl_coef)

    # ---- one step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        timings, start = Timings(), time.perf_counter()
        samples, pending, dropped, seen = self.rollouts(timings)
        micro, length, mine = self.micro_batches(samples)
        with timings("logprobs"):
            self.attach_old_logprobs(micro, length)
        with timings("reference"):
            if self.reference is not None:
                attach(micro, "ref_logprobs", self.reference_logprobs(micro, length))
        if not self.a.dynamic_sampling.enabled:  # the scores were computed while the log-probs were
            with timings("score_wait"):
                self.apply_scores(samples, pending, timings)
        if self.reference is not None and self.a.kl.mode == "reward":
            rl_samples.subtract_kl(samples, self.sample_kl(micro, mine, samples), self.kl_coef)
        rl_samples.set_advantages(samples, self.a)
        for batch, group in zip(micro, self.groups_of(mine)):
            batch["advantages"] = torch.tensor([s.advantage for s in group], dtype=torch.float32)
            batch["response_mask"] = batch["response_mask"] * torch.tensor([[float(s.valid)] for s in group])
        with timings("train"):
            update = self.update(micro, length, samples)
        with timings("refit"):
            self.engine.refit()
            refit = self.refit_metrics()
        metrics = {**rl_samples.rollout_metrics(samples, dropped, seen), **update, **refit}
        timings["step"] = time.perf_counter() - start
        metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
        generated = sum(len(s.response_ids) for s in samples)
        metrics["throughput/generated_tokens_per_s"] = generated / max(timings["generate"], 1e-9)
        metrics["consumed_samples"] = self.sampler.state_dict()["consumed_samples"]
        self.write_rollouts(samples)
        return metrics

    # ---- generation and scoring -----------------------------------------------------------------------
    def rollouts(self, timings: Timings):
        """(the step's samples, their pending scores or None, dropped groups, groups seen). Without
        dynamic sampling the scores are left pending, to be awaited after the log-prob passes."""
        a = self.a
        with timings("generate"):
            samples = self.generate(self.next_prompts())
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
                self.apply_scores(samples, pending, timings)
            for group in rl_samples.groups_of(samples, a.num_generations):
                (kept if rl_samples.informative(group) else dropped).append(group)
            if len(kept) >= a.prompts_per_step:
                break
        return (rl_samples.choose_groups(kept, dropped, a.prompts_per_step), None, len(dropped),
                len(kept) + len(dropped))

    def next_prompts(self) -> list:
        """The step's prompts from the stateful sampler, and the id of their first sample."""
        indices = self.sampler.next_global_batch()
        self.first_sample_id = (self.sampler.consumed_samples - len(indices)) * self.a.num_generations
        return [self.train_data[i] for i in indices]

    def generate(self, prompts: list, params: SamplingParams | None = None, generations: int | None = None,
                 first_id: int | None = None) -> list[Sample]:
        """`generations` samples of each prompt, group after group, on every rank. Prompts are split
        over data-parallel replicas; sample k of the run (counted over consumed prompts) is seeded
        with (trainer.seed, k), so a sample does not depend on the layout or the batch size."""
        params = params or self.params
        n = self.a.num_generations if generations is None else generations
        first_id = self.first_sample_id if first_id is None else first_id
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        share = -(-len(prompts) // dp)
        mine = range(dp_rank * share * n, min(len(prompts), (dp_rank + 1) * share) * n)
        rollout = self.engine.generate([prompts[k // n].ids for k in mine], params,
                                       seeds=[rng.derive_seed(params.seed, first_id + k) for k in mine])
        part = (rollout.responses(), rollout.response_logprobs(), rollout.is_end.tolist())
        parts = collectives.all_gather_object(part, group=ps.get_data_parallel_group())
        responses, logprobs, ends = ([x for p in parts for x in p[i]] for i in range(3))
        return [Sample(prompts[k // n], r, lp, e) for k, (r, lp, e) in enumerate(zip(responses, logprobs, ends))]

    def submit_scores(self, samples: list[Sample]):
        """The reward functions' future on global rank 0 (None elsewhere), stamped with its duration."""
        if self.scorer is None:
            return None
        prompts = [s.prompt for s in samples]
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        started = time.perf_counter()
        future = self.scorer.submit([p.text for p in prompts], texts, [p.fields for p in prompts])
        future.add_done_callback(lambda f: setattr(f, "duration", time.perf_counter() - started))
        return future

    def apply_scores(self, samples: list[Sample], pending, timings: Timings | None = None) -> None:
        """Wait for the scores on rank 0, share them with every rank, set rewards and validity."""
        scores = None
        if pending is not None:
            scores = pending.result()
            if timings is not None:
                timings["score"] += getattr(pending, "duration", 0.0)
        rl_samples.apply_scores(samples, collectives.broadcast_object(scores, src=0), self.a,
                                self.params.max_new_tokens)

    # ---- log-probs and updates ------------------------------------------------------------------------
    def minibatches(self, samples: list) -> list[list]:
        size = self.cfg.trainer.global_batch_size
        return [samples[i:i + size] for i in range(0, len(samples), size)]

    def groups_of(self, mine: list) -> list[list]:
        """This rank's micro-batches of samples, minibatch after minibatch."""
        mbs = self.cfg.trainer.micro_batch_size
        per_rank = self.cfg.trainer.global_batch_size // self.dp_size
        return [mine[i + j:i + j + mbs] for i in range(0, len(mine), per_rank) for j in range(0, per_rank, mbs)]

    def micro_batches(self, samples: list[Sample]):
        """(this rank's micro-batches of the whole step, their length, this rank's samples in order)."""
        mine = [s for mb in self.minibatches(samples) for s in split_for_rank(mb, self.dp_rank, self.dp_size)]
        micro, length = rl_micro_batches(self.groups_of(mine), self.tokenizer.pad_token_id, self.packing,
                                         self.length_multiple)
        return micro, length, mine

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
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            per_sample = []
            for batch in micro:
                mask = batch["response_mask"]
                values = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], str(self.a.kl.estimator))
                per_sample += ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
            where = {id(s): i for i, s in enumerate(samples)}
            for sample, value in zip(mine, per_sample):
                kl[where[id(sample)]] = value
        return collectives.all_reduce(kl).tolist()

    def update(self, micro: list[dict], length: int, samples: list[Sample]) -> dict:
        """ppo_epochs x minibatches optimizer steps; the summed reports as metrics."""
        per_minibatch = len(micro) // len(self.minibatches(samples))
        totals, grad_norms, lr = defaultdict(float), [], float("nan")
        for _ in range(self.a.ppo_epochs):
            for k, minibatch in enumerate(self.minibatches(samples)):
                if not any(s.valid for s in minibatch):
                    continue  # nothing to learn from (all unscored or filtered): no update
                self.model.train()
                sums = forward_backward(self.model, self.optimizer, self.loss_step,
                                        micro[k * per_minibatch:(k + 1) * per_minibatch], length)
                grad_norm, lr = optimizer_step(self.optimizer, self.scheduler)
                grad_norms.append(grad_norm)
                for key, value in sums.items():
                    totals[key] += value
        tokens, count = max(totals["tokens"], 1.0), max(totals["count"], 1.0)
        metrics = {"loss": totals["loss"] / count, "lr": lr, "optimizer_steps": float(len(grad_norms)),
                   "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
                   "entropy/mean": totals["entropy"] / tokens, "policy/clip_fraction": totals["clip_fraction"] / tokens,
                   "policy/approx_kl": totals["approx_kl"] / tokens,
                   "mismatch/token_prob_error": totals["token_prob_error"] / tokens,
                   "mismatch/kl": totals["mismatch_kl"] / tokens}
        if "kl" in totals:
            metrics["kl/mean"] = totals["kl"] / tokens
        return metrics

    def refit_metrics(self) -> dict:
        if not self.cfg.generation.check_refit:
            return {}
        check = self.engine.refit_check(self.model)
        return {"refit/bitwise": float(check["bitwise"]), "refit/max_abs_diff": float(check["max_abs_diff"])}

    # ---- validation and rollouts ---------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict:
        """Greedy responses to every validation prompt: val/reward/mean over the scored ones."""
        greedy = self.params.replace(greedy=True)
        samples = self.generate(list(self.val_data), greedy, generations=1, first_id=0)
        self.score_validation(samples)
        scores = [s.score for s in samples if s.score is not None]
        metrics = {"val/reward/mean": sum(scores) / len(scores) if scores else float("nan"),
                   "val/fraction/unscored": 1 - len(scores) / len(samples),
                   "val/response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples)}
        metrics.update(self.validation_functions(samples))
        return metrics

    def score_validation(self, samples: list[Sample]) -> None:
        self.apply_scores(samples, self.submit_scores(samples))

    def validation_functions(self, samples: list[Sample]) -> dict:
        """val/<name>/mean of each of `reward.val_functions` over the validation samples (every rank)."""
        scores = {}
        if self.val_scorer is not None:
            texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
            scores = self.val_scorer.submit_each([s.prompt.text for s in samples], texts,
                                                 [s.prompt.fields for s in samples]).result()
        scores = collectives.broadcast_object(scores, src=0)
        return {f"val/{name}/mean": sum(v for v in values if v is not None) / max(1, sum(v is not None for v in values))
                for name, values in scores.items()}

    def write_rollouts(self, samples: list[Sample]) -> None:
        if not self.is_logger or not self.a.log_rollouts:
            return
        path = self.run_dir / "rollouts" / f"step_{self.step + 1:06d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        shown = samples[:self.a.log_rollouts]
        texts = self.tokenizer.batch_decode([s.response_ids for s in shown], skip_special_tokens=True)
        with open(path, "w") as f:
            for sample, text in zip(shown, texts):
                f.write(json.dumps({"prompt": sample.prompt.text, "response": text,
                                    "score": sample.score, "reward": sample.reward, "advantage": sample.advantage,
                                    "valid": sample.valid, "is_end": sample.is_end}) + "\n")
