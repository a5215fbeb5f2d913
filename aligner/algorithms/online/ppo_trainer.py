"""The PPO step (`aligner train ppo`, README "PPO with the critic service"), on top of the online loop of
`online/rl.py`. `PPOTrainer.train_step`, top to bottom:

  prompts -> generate in rollout micro-batches of `generation.batch_size` prompts; as soon as one is
     generated, its critic-values and reward-model requests go out as futures (generation overlaps them)
  -> the actor's (old) and the reference's per-token log-probs, while the service works
  -> collect the futures (`timing/critic_wait_s`); a dead service stops the run (exit 75, `ServiceLost`)
  -> scores (standardised and clipped on request) -> token rewards = score at the last response token
     - kl_coef x KL per token -> GAE(gamma, lam) on the critic's values -> advantages whitened over the
     whole step (every rank holds every sample, so this is the global masked mean and variance)
  -> `critic_train(returns, old values, mask)` sent without waiting: the critic trains while the actor does
  -> the actor's minibatch updates (skipped during `critic_warmup_steps`) -> refit -> the critic's reply
  -> the adaptive KL coefficient -> metrics.
Only global rank 0 talks to the service; what it receives is broadcast. A checkpoint at step N first has
the service save the critic for step N, then saves the actor, so the newest actor checkpoint always has
its critic (`online/ppo.py` starts or tells the service to load that step on resume).

Per-response-token tensors are [N, T] over the step's N samples (T = the longest response); the critic's
value for response token j of a sample with prompt length P is its value at position P - 1 + j (the state
before the token), the position whose logits give the token's log-prob.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from megatron.core import parallel_state as ps

from aligner.algorithms.online import maths
from aligner.algorithms.online import samples as rl_samples
from aligner.algorithms.online.rl import RLTrainer
from aligner.algorithms.online.rollouts import Timings
from aligner.algorithms.online.samples import Sample
from aligner.algorithms.shared.maths import masked_mean
from aligner.runtime import collectives
from aligner.runtime.preemption import Preempted


class ServiceLost(Preempted):
    """The critic/reward service stopped answering within its deadline: the run stops (exit 75, like a
    preemption) at its last checkpoint, which is consistent, and re-running the command resumes it."""

    def __init__(self, step: int, message: str):
        super().__init__(step)
        self.message = message

    def __str__(self) -> str:
        return (f"{self.message}; stopped during step {self.step + 1}: the last checkpoint is consistent, re-run the "
                f"same command to resume")


class PPOTrainer(RLTrainer):
    def __init__(self, cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size: int, tokenizer, engine,
                 service, reference, packing: dict, val_scorer=None, workers=None):
        """service: a `ppo.Service` (critic + reward clients) on global rank 0, None elsewhere; workers: as
        `RolloutTrainer`'s."""
        super().__init__(cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size, tokenizer, engine,
                         service.scorer if service is not None else None, reference, packing, val_scorer, workers)
        self.service = service
        self.needs_old_logprobs = True  # the KL in the reward and the ratio use the rollout policy's log-probs

    # ---- one step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        timings, start = Timings(), time.perf_counter()
        samples, pending = self.rollouts_with_requests(timings)
        self.engine_sleeps()
        micro, length, mine = self.micro_batches(samples)
        self.logprob_passes(micro, length, timings)
        with timings("critic_wait"):
            values, scores, served = self.await_service(samples, pending)
        timings["critic_infer_server"] = served
        rl_samples.apply_scores(samples, scores, self.a, self.params.max_new_tokens)
        if self.a.mask_truncated:
            for s in samples:
                s.valid = s.valid and s.is_end
        mask = self.response_table(samples, lambda s: [float(s.valid)] * len(s.response_ids))
        kl = self.gathered(micro, mine, samples, "kl")
        sequence_kl = (kl * mask).sum(-1)
        rewards = maths.token_rewards(self.shaped_scores(samples), kl, mask, self.kl_coef)
        advantages, returns = maths.gae(rewards, values, mask, self.a.gamma, self.a.lam)
        if self.a.whiten_advantages:
            mean = masked_mean(advantages, mask)
            var = masked_mean((advantages - mean).pow(2), mask)
            advantages = torch.where(mask.bool(), (advantages - mean) * torch.rsqrt(var + 1e-8), 0.0)
        for s, row in zip(samples, advantages):
            s.advantage = float(row[:len(s.response_ids)].sum())  # the rollouts file's summary only
        with timings("critic_train_send"):
            training = self.send_critic_train(samples, returns, values, mask)
        rows = {id(s): i for i, s in enumerate(samples)}
        for batch, group in zip(micro, self.groups_of(mine)):
            index = torch.tensor([rows[id(s)] for s in group])
            width = batch["response_mask"].shape[1]
            batch["advantages"] = advantages[index, :width]
            batch["response_mask"] = mask[index, :width]
        warmup = self.step < self.a.critic_warmup_steps
        with timings("train"):
            update = {} if warmup else self.update(micro, length, samples)
        with timings("refit"):
            if not warmup and self.separate is None:  # separate workers get the weights the schedule needs
                self.engine.refit()
            refit = self.refit_metrics()
        with timings("critic_train"):
            critic = self.await_critic_train(training)
        metrics = {**rl_samples.rollout_metrics(samples, 0, self.a.prompts_per_step), **update, **refit, **critic}
        valid = mask.bool()
        metrics.update({"returns/mean": masked_mean(returns, mask).item(),
                        "value/mean": masked_mean(values, mask).item(),
                        "value/explained_variance": maths.explained_variance(values, returns, mask).item(),
                        "kl/mean": masked_mean(kl, mask).item() if valid.any() else 0.0,
                        "kl/sequence_mean": sequence_kl[valid.any(-1)].mean().item() if valid.any() else 0.0,
                        "kl/coef": self.kl_coef, "critic_warmup": float(warmup),
                        "advantages/mean": masked_mean(advantages, mask).item(),
                        "advantages/std": masked_mean((advantages - masked_mean(advantages, mask)).pow(2),
                                                        mask).sqrt().item()})
        if self.a.kl.target is not None and not warmup:
            self.kl_coef = maths.adaptive_kl_coef(self.kl_coef, metrics["kl/sequence_mean"], self.a.kl.target,
                                              self.a.kl.horizon, len(samples))
        return self.finish_step(metrics, timings, start, samples)

    # ---- rollouts and the service ------------------------------------------------------------------------
    def rollouts_with_requests(self, timings: Timings) -> tuple[list[Sample], list]:
        """The step's samples, generated `generation.batch_size` prompts at a time; each chunk's requests
        leave (rank 0) as soon as it exists."""
        if self.separate is not None:  # the workers' rollouts arrive whole
            samples = self.step_samples(timings)
            return samples, [self.service.submit(samples, self.tokenizer)] if self.service is not None else []
        prompts, first = self.next_prompts(), self.first_sample_id
        chunk, n = self.cfg.generation.batch_size, self.a.num_generations
        samples, pending = [], []
        for i in range(0, len(prompts), chunk):
            with timings("generate"):
                part = self.generate(prompts[i:i + chunk], first_id=first + i * n)
            samples += part
            if self.service is not None:
                pending.append(self.service.submit(part, self.tokenizer))
        return samples, pending

    def await_service(self, samples: list[Sample], pending: list) -> tuple[torch.Tensor, list, float]:
        """(values [N, T], scores (None = unscored), the service's own seconds), on every rank."""
        result = None
        if self.service is not None:
            try:
                result = self.service.await_values_and_scores(pending, samples)
            except ConnectionError as e:
                result = str(e)
        result = collectives.broadcast_object(result, src=0)
        if isinstance(result, str):
            raise ServiceLost(self.step, result)
        values, scores, seconds = result
        return torch.as_tensor(values), scores, seconds

    def score_validation(self, samples: list[Sample]) -> None:
        """The service's reward (+ reward functions) of the greedy validation samples; no values."""
        pending = [self.service.submit(samples, self.tokenizer, values=False)] if self.service is not None else []
        _, scores, _ = self.await_service(samples, pending)
        rl_samples.apply_scores(samples, scores, self.a, self.params.max_new_tokens)

    def send_critic_train(self, samples: list[Sample], returns, values, mask):
        """Rank 0: the critic_train future, rows = samples, columns = sequence positions (see the module doc)."""
        if self.service is None or not mask.any():
            return None
        width = max(len(s.prompt.ids) + len(s.response_ids) for s in samples)
        tokens = np.full((len(samples), width), self.tokenizer.pad_token_id, dtype=np.int64)
        seq = {k: np.zeros((len(samples), width), dtype=np.float32) for k in ("returns", "prev_values", "mask")}
        for i, s in enumerate(samples):
            ids, _ = s.sequence()
            tokens[i, :len(ids)] = ids
            at = slice(len(s.prompt.ids) - 1, len(ids) - 1)
            r = len(s.response_ids)
            seq["returns"][i, at] = returns[i, :r].numpy()
            seq["prev_values"][i, at] = values[i, :r].numpy()
            seq["mask"][i, at] = mask[i, :r].numpy()
        return self.service.critic.train(tokens, seq["returns"], seq["prev_values"], seq["mask"])

    def await_critic_train(self, training) -> dict:
        result = {}
        if self.service is not None and training is not None:
            try:
                result = self.service.train_result(training)
            except ConnectionError as e:
                result = str(e)
        result = collectives.broadcast_object(result, src=0)
        if isinstance(result, str):
            raise ServiceLost(self.step, result)
        return result

    def save(self) -> None:
        """The critic's checkpoint for this step first, then the actor's (see the module doc)."""
        lost = None
        if self.service is not None:
            try:
                self.service.save(self.step)
            except ConnectionError as e:
                lost = str(e)
        lost = collectives.broadcast_object(lost, src=0)
        if lost is not None:
            raise ServiceLost(self.step - 1, lost)
        super().save()

    # ---- per-token tables --------------------------------------------------------------------------------
    @staticmethod
    def response_table(samples: list[Sample], row_of) -> torch.Tensor:
        width = max(len(s.response_ids) for s in samples)
        return torch.tensor([row_of(s) + [0.0] * (width - len(s.response_ids)) for s in samples], dtype=torch.float32)

    def gathered(self, micro: list[dict], mine: list[Sample], samples: list[Sample], what: str) -> torch.Tensor:
        """[N, T] per-token KL(old || reference) of every sample on every rank (zeros without a reference):
        each sample's row is filled by its data-parallel owner's last stage, then summed over the world."""
        width = max(len(s.response_ids) for s in samples)
        table = torch.zeros(len(samples), width)
        if self.reference is None:
            return table
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
                ps.get_context_parallel_rank() == 0:  # CP ranks hold the same whole rows (loss.response_values)
            rows = {id(s): i for i, s in enumerate(samples)}
            k = 0
            for batch in micro:
                values = maths.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], str(self.a.kl.estimator))
                for row in (values * batch["response_mask"]).cpu():  # one copy from the GPU, not one a row
                    sample = mine[k]
                    table[rows[id(sample)], :len(sample.response_ids)] = row[:len(sample.response_ids)]
                    k += 1
        return collectives.all_reduce(table)

    def shaped_scores(self, samples: list[Sample]) -> torch.Tensor:
        """[N] the scores the token rewards get: standardised over the step's valid samples and clipped
        when asked; 0 for invalid samples (whose tokens are all masked out anyway)."""
        scores = torch.tensor([s.reward if s.valid else 0.0 for s in samples])
        valid = torch.tensor([s.valid for s in samples])
        o = self.a.scores
        if o.standardize and valid.sum() > 1:
            mean, std = scores[valid].mean(), scores[valid].std(unbiased=False)
            scores = torch.where(valid, (scores - mean) / (std + 1e-6), 0.0)
        if o.clip is not None:
            scores = scores.clamp(-o.clip, o.clip)
        return scores
