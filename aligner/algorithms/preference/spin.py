"""`aligner train spin`: Self-Play fIne-tuNing (Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak
Language Models to Strong Language Models").

The data is an SFT file. Training runs in iterations of `spin.steps_per_iteration` optimizer steps;
at the start of iteration k:
  1. the reference becomes the current policy (the "opponent" of the paper),
  2. the policy generates one response per prompt with the in-process generation engine (sharing
     the trainer's weights; prompts split over data-parallel replicas, sample i of iteration k
     seeded with (spin.seed, k * n + i)),
  3. each prompt becomes a DPO pair: chosen = the ground-truth response, rejected = the generation.
The iteration then trains DPO (`dpo.*`, sigmoid by default: the SPIN loss with the logistic loss)
on those pairs. A prompt's "response" is everything from the first trained token of the SFT sample
on (its loss mask), so single-turn data is what this expects.

Resume: a checkpoint is written at every iteration boundary and the iteration's pairs are kept in
`<run_dir>/spin/iteration_<k>.pt`; a run resumed inside iteration k reads its pairs back and takes
its reference from the boundary checkpoint (step k * steps_per_iteration), so the resumed steps
equal an uninterrupted run. Metrics: DPO's, plus `spin/iteration` on every step and, on the first
step of an iteration, `spin/gen_match` (fraction of ground-truth response tokens the generation
reproduces at the same position), `spin/exact` (identical responses) and `spin/response_length`.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.algorithms.preference.losses import DPO
from aligner.algorithms.shared.sequence_trainer import SequenceFormat, SequenceTrainer
from aligner.algorithms.shared.reference import named_parameters
from aligner.algorithms.shared.sequence_logprobs import sequence_loss_step
from aligner.config import load_resolved
from aligner.data.preference import PreferencePair
from aligner.data.sft import load_sft_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.files import atomic_write
from aligner.generation import rng
from aligner.generation.backends import build_engine
from aligner.generation.types import SamplingParams
from aligner.models import checkpoint, lora
from aligner.models.gpt import build_gpt
from aligner.models.policy import build_policy
from aligner.models.training import wrap_for_training
from aligner.runtime import distributed
from aligner.runtime import collectives

log = logging.getLogger(__name__)


def split_sample(ids: list[int], loss_mask: list[int]) -> tuple[list[int], list[int]]:
    """An SFT sample -> (prompt ids, ground-truth response ids): the response starts at the first
    trained token."""
    start = loss_mask.index(1)
    return ids[:start], ids[start:]


def spin_pairs(prompts: list[list[int]], truths: list[list[int]], generations: list[list[int]],
               max_length: int) -> list:
    """chosen = prompt + ground truth, rejected = prompt + generation (cut to `max_length` tokens)."""
    return [PreferencePair(chosen=p + t, rejected=(p + g)[:max_length], chosen_start=len(p), rejected_start=len(p))
            for p, t, g in zip(prompts, truths, generations)]


def generation_metrics(truths: list[list[int]], generations: list[list[int]]) -> dict:
    matched = sum(sum(a == b for a, b in zip(t, g)) for t, g in zip(truths, generations))
    return {"spin/gen_match": matched / max(1, sum(map(len, truths))),
            "spin/exact": sum(t == g for t, g in zip(truths, generations)) / len(truths),
            "spin/response_length": sum(map(len, generations)) / len(generations)}


class SPINTrainer(SequenceTrainer):
    """The preference loop with a generation phase: at each iteration boundary `generate` renews the
    pairs and the reference, then the iteration's steps train DPO on them."""

    def __init__(self, *args, prompts, truths, engine, spin_cfg, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts, self.truths, self.engine, self.spin = prompts, truths, engine, spin_cfg
        self.iteration = -1  # the iteration whose pairs are loaded

    def _pairs_path(self, k: int) -> Path:
        return self.run_dir / "spin" / f"iteration_{k}.pt"

    def _boundary_checkpoint(self, k: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{k * self.spin.steps_per_iteration:06d}"

    def resume(self) -> None:
        super().resume()  # the reference starts as the initial policy
        k, inside = divmod(self.step, self.spin.steps_per_iteration)
        if inside:  # resumed inside iteration k: its pairs, and the policy of its first step as reference
            self.train_data = torch.load(self._pairs_path(k), weights_only=False)
            if k > 0:
                self._reference_from_checkpoint(self._boundary_checkpoint(k))
            self.iteration = k

    def _reference_from_checkpoint(self, path: Path) -> None:
        weights = build_policy(self.cfg.model, self.vocab_size)
        if lora.enabled(self.cfg.model.lora):  # the reference is the base with that step's adapters
            lora.add_adapters(weights, self.cfg.model.lora)
            checkpoint.load_adapted(path, weights)
        else:
            checkpoint.load_weights(path, weights)
        self.reference.load_from(named_parameters(weights))

    def before_train_step(self) -> dict:
        k = self.step // self.spin.steps_per_iteration
        metrics = self.generate(k) if k != self.iteration else {}
        return {**metrics, "spin/iteration": k}

    def generate(self, k: int) -> dict:
        """The generation phase of iteration k: the reference becomes the current policy, which
        generates the iteration's rejected responses; returns the generation metrics."""
        if k > 0 and not self._boundary_checkpoint(k).exists():
            self.save()  # a resumed run inside iteration k reads its reference from here
        self.reference.load_from(named_parameters(self.model))
        self.engine.refit()  # a no-op for the megatron engine, which reads the live weights
        s = self.spin
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, greedy=s.greedy,
                                max_new_tokens=s.max_new_tokens, seed=s.seed)
        n = len(self.prompts)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        share = -(-n // dp)
        mine = list(range(dp_rank * share, min(n, (dp_rank + 1) * share)))
        rollout = self.engine.generate([self.prompts[i] for i in mine], params,
                                       seeds=[rng.derive_seed(s.seed, k * n + i) for i in mine])
        self.engine.sleep()  # until the next iteration's refit or generation wakes it
        parts = collectives.all_gather_object(rollout.responses(), group=ps.get_data_parallel_group())
        generations = [g for part in parts for g in part]
        self.train_data = spin_pairs(self.prompts, self.truths, generations, self.cfg.data.max_length)
        metrics = generation_metrics(self.truths, generations)
        if dist.get_rank() == 0:
            path = self._pairs_path(k)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, "wb") as f:
                torch.save(self.train_data, f)
        collectives.barrier()
        self.iteration = k
        if self.is_logger:
            log.info("SPIN iteration %d: %d pairs, generation matches %.3f of the ground truth", k, n,
                     metrics["spin/gen_match"])
        return metrics


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "spin"))


def run(cfg) -> None:
    """One rank of `aligner train spin` with a validated config."""
    m, d = cfg.model, cfg.data
    distributed.start_training_rank(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)
    sft = load_sft_dataset(d.train_path, tokenizer, d.format, d.max_length, d.overlong)
    prompts, truths = zip(*(split_sample(s.ids, s.loss_mask) for s in sft))
    # The model reads row positions (no packing), which is what the generation engine runs.
    model, optimizer, scheduler = wrap_for_training(build_gpt(m, vocab_size), m, cfg.optim)
    engine = build_engine(str(cfg.generation.backend), model, m, vocab_size, tokenizer,
                          batch_size=cfg.spin.generation_batch_size, tokenizer_dir=cfg.tokenizer.path,
                          checkpoint=m.pretrained)
    dpo = DPO(cfg.dpo)
    mode = cfg.reference.mode
    placeholder = spin_pairs(list(prompts), list(truths), list(truths), d.max_length)  # replaced at the first step
    trainer = SPINTrainer(cfg, model, optimizer, scheduler, sequence_loss_step(dpo.loss, vocab_size),
                          placeholder, None, SequenceFormat(dpo, tokenizer.pad_token_id), vocab_size, tokenizer,
                          algorithm=dpo, reference_mode=mode, packing={"packed": False, "capacity": None},
                          prompts=list(prompts), truths=list(truths), engine=engine, spin_cfg=cfg.spin)
    trainer.fit()
    distributed.shutdown()

