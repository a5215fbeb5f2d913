"""What every online trainer (GRPO family, REINFORCE, PPO, RS) does around its own step: draw prompts,
generate on every data-parallel (and context-parallel) replica with per-sample seeds, score on global
rank 0 and share the scores, cut the step's samples into this rank's micro-batches, run minibatch updates
with the trainer's loss step, check the engine's refit, validate greedily, and finish the step's metrics. `RolloutTrainer`
is their one constructor; `online/rl.py`, `online/ppo_trainer.py` and `online/rs.py` add their steps."""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
from megatron.core import parallel_state as ps

from aligner.algorithms.online import multiturn
from aligner.algorithms.online import samples as samples_lib
from aligner.algorithms.online.loss import rl_micro_batches
from aligner.algorithms.online.samples import Sample
from aligner.algorithms.online.separate import SeparateRollouts
from aligner.algorithms.shared.trainer import Trainer
from aligner.algorithms.shared.training_step import forward_backward, optimizer_step
from aligner.data.loader import split_for_rank
from aligner.generation import rng
from aligner.generation.types import SamplingParams
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


class RolloutTrainer(Trainer):
    validate_at_start = True

    def __init__(self, cfg, model, optimizer, scheduler, prompts, val_prompts, vocab_size: int, tokenizer, engine,
                 scorer, packing: dict, algorithm, val_scorer=None, workers=None):
        """prompts: `aligner.data.prompts.Prompt`s; engine: a `GenerationBackend` (with separate rollout workers,
        it generates the validation); scorer: a `RewardScorer` on global rank 0, None elsewhere; val_scorer: a
        `RewardScorer` of `reward.val_functions` (rank 0), scored on validation only; algorithm: the
        `RLAlgorithmConfig` of the run (RS builds its own); workers: `generation.workers.RolloutWorkers` on
        global rank 0 under generation.placement=separate. Subclasses set `self.loss_step`, the forward step
        `update` trains with."""
        self.a = algorithm  # before the shared loop's constructor, which asks samples_per_step
        super().__init__(cfg, model, optimizer, scheduler, None, prompts, val_prompts, None, vocab_size, tokenizer)
        s = cfg.sampling
        self.engine, self.scorer, self.val_scorer, self.packing = engine, scorer, val_scorer, packing
        self.params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                     max_new_tokens=s.max_new_tokens, stop_strings=tuple(s.stop_strings),
                                     seed=cfg.trainer.seed)
        self.loss_step = None
        self.first_sample_id = 0  # seed index of the first sample of the prompts just drawn
        self.drawn_indices: list[int] = []  # their indices in the prompt set
        self.multiturn = cfg.get("env") is not None and cfg.env.name is not None  # episodes with an environment
        self.env_pool = multiturn.start_env_pool(cfg) if self.multiturn else None
        self.env_s = 0.0  # the environments' seconds in this step's generates (dynamic sampling's refills too)
        separate = cfg.generation.get("placement", "colocated") == "separate"
        self.separate = SeparateRollouts(self, workers, algorithm["async"].max_lag) if separate else None

    def samples_per_step(self) -> int:
        return self.a.prompts_per_step

    def finish_step(self, metrics: dict, timings: Timings, start: float, samples: list[Sample]) -> dict:
        """The step's timings, generation throughput and consumed samples added to `metrics`; rollouts
        written. The last thing every online step does."""
        timings["step"] = time.perf_counter() - start
        metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
        if self.multiturn:  # over the episodes the step trains (its batch), the environments' time over all
            metrics.update(multiturn.step_metrics(samples, self.env_s))
        generated = sum(len(s.response_ids) for s in samples)
        seconds = timings["generate"] if self.separate is None else self.separate.worker_seconds
        metrics["throughput/generated_tokens_per_s"] = generated / max(seconds, 1e-9)
        ahead = self.separate.pending_samples() if self.separate is not None else 0  # drawn for later steps
        metrics["consumed_samples"] = self.sampler.state_dict()["consumed_samples"] - ahead
        if self.separate is not None:
            metrics.update(self.separate.metrics(self.step + 1))
        self.write_rollouts(samples)
        return metrics

    def loop_state(self) -> dict:
        return {"separate": self.separate.state()} if self.separate is not None else {}

    def load_loop_state(self, state: dict) -> None:
        if self.separate is not None:
            self.separate.load_state(state.get("separate", {}))

    def save(self) -> None:
        if self.separate is not None:
            self.separate.before_save(self.step)
        super().save()

    def resume(self) -> None:
        super().resume()
        if self.separate is not None:
            self.separate.after_resume(self.step)

    # ---- generation and scoring -----------------------------------------------------------------------
    def step_samples(self, timings: Timings) -> list[Sample]:
        """The step's samples: generated here on the live weights, or the separate workers' on the lag
        schedule (online/separate.py)."""
        self.env_s = 0.0
        if self.separate is not None:
            return self.separate.samples(timings)
        with timings("generate"):
            return self.generate(self.next_prompts())

    def engine_sleeps(self) -> None:
        """The step's generation is done: a colocated engine hands the memory it holds (TensorRT-LLM's KV cache
        and weights) to the trainer's passes until the refit or the next generation wakes it."""
        if self.separate is None:
            self.engine.sleep()

    def next_prompts(self) -> list:
        """The step's prompts from the stateful sampler, and the id of their first sample."""
        indices = self.drawn_indices = self.sampler.next_global_batch()
        self.first_sample_id = (self.sampler.consumed_samples - len(indices)) * self.a.num_generations
        return [self.train_data[i] for i in indices]

    def generate(self, prompts: list, params: SamplingParams | None = None, generations: int | None = None,
                 first_id: int | None = None) -> list[Sample]:
        """`generations` samples of each prompt, group after group, on every rank. Prompts are split
        over the engine's replicas: the data-parallel ones, each context-parallel rank a replica of its
        own (it holds its TP shard's whole weights, and the engine runs whole sequences); sample k of the
        run (counted over consumed prompts) is seeded with (trainer.seed, k), so a sample does not depend
        on the layout or the batch size."""
        params = params or self.params
        n = self.a.num_generations if generations is None else generations
        first_id = self.first_sample_id if first_id is None else first_id
        if self.multiturn:
            samples, metrics = multiturn.generate_episodes(
                self.engine, self.tokenizer, prompts, n, first_id, params, self.cfg.env, self.env_pool, self.step,
                self.cfg.model.seq_length)
            self.env_s += metrics["timing/env_s"]
            return samples
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        share = -(-len(prompts) // dp)
        mine = range(dp_rank * share * n, min(len(prompts), (dp_rank + 1) * share) * n)
        rollout = self.engine.generate([prompts[k // n].ids for k in mine], params,
                                       seeds=[rng.derive_seed(params.seed, first_id + k) for k in mine])
        part = (rollout.responses(), rollout.response_logprobs(), rollout.is_end.tolist())
        parts = collectives.all_gather_object(part, group=ps.get_data_parallel_group(with_context_parallel=True))
        responses, logprobs, ends = ([x for p in parts for x in p[i]] for i in range(3))
        return [Sample(prompts[k // n], r, lp, e, version=self.step)  # the live weights: `step` updates so far
                for k, (r, lp, e) in enumerate(zip(responses, logprobs, ends))]

    def submit_scores(self, samples: list[Sample]):
        """The reward functions' future on global rank 0 (None elsewhere), stamped with its duration."""
        if self.scorer is None:
            return None
        if self.multiturn:  # the environments scored the episodes
            return multiturn.scores_future(samples)
        prompts = [s.prompt for s in samples]
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        started = time.perf_counter()
        future = self.scorer.submit([p.text for p in prompts], texts, [p.fields for p in prompts])
        future.add_done_callback(lambda f: setattr(f, "duration", time.perf_counter() - started))
        return future

    def await_scores(self, samples: list[Sample], pending, timings: Timings | None = None) -> None:
        """Wait for the scores on rank 0, share them with every rank, set rewards and validity."""
        scores = None
        if pending is not None:
            scores = pending.result()
            if timings is not None:
                timings["score"] += getattr(pending, "duration", 0.0)
        samples_lib.apply_scores(samples, collectives.broadcast_object(scores, src=0), self.a,
                                 self.params.max_new_tokens)

    # ---- micro-batches and updates --------------------------------------------------------------------
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
        if "is_truncated" in totals:
            metrics["policy/is_truncated_fraction"] = totals["is_truncated"] / tokens
        return metrics

    def refit_metrics(self) -> dict:
        if not self.cfg.generation.check_refit:
            return {}
        check = self.engine.refit_check(self.model)
        return {"refit/bitwise": float(check["bitwise"]), "refit/max_abs_diff": float(check["max_abs_diff"])}

    # ---- validation ---------------------------------------------------------------------------------
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
        if self.multiturn:  # the validation episodes' turns, tool calls and ends (val/episode/*, val/fraction/*)
            metrics.update({f"val/{k}": v for k, v in multiturn.step_metrics(samples, 0.0).items()
                            if not k.startswith("timing/")})
        metrics.update(self.validation_functions(samples))
        return metrics

    def score_validation(self, samples: list[Sample]) -> None:
        self.await_scores(samples, self.submit_scores(samples))

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
