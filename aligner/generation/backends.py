"""The rollout engine a command generates with (`generation.backend`), built in one place.

megatron  `MegatronEngine` on the trainer's own (live) weights: no copy, refit is a no-op.
trtllm    TensorRT-LLM (`trtllm_engine.TensorRTLLMEngine`): one instance for the whole job, held by global
          rank 0, with `model.tensor_model_parallel_size` workers on the first GPUs of rank 0's node. The
          first `generate` starts it from a Hugging Face export of the live weights (written through the
          weight stream into a temporary directory under $TMPDIR: the model's size in its dtype, on rank
          0's node), so a resumed run starts from its resumed weights;
          each `refit` then streams the live weights into it. The loops call it as they call the megatron
          engine: every rank calls `generate` with its data-parallel replica's prompts, the replicas'
          prompts are generated together on rank 0, and each rank gets its replica's rollout back (the
          other GPUs wait meanwhile). This path has never run (README, TensorRT-LLM).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from aligner.config.generation_schema import TRTLLM_NO_REFIT_CHECK
from aligner.generation import rng
from aligner.generation.types import GenerationBackend, Rollout, SamplingParams, WeightStream
from aligner.models import hf_weights as hw
from aligner.models.checkpoint import read_metadata
from aligner.models.hf_convert import write_hf_dir
from aligner.runtime import collectives
from aligner.runtime.optional import require

# the megatron engine and TensorRT-LLM are imported where they are used: one backend never imports the other.
# megatron, and the modules that import it, are imported inside the functions too: `aligner generate`'s CLI
# process imports this module before it launches ranks.


def build_engine(backend: str, model, model_cfg, vocab_size: int, tokenizer, *, batch_size: int,
                 decode: str = "auto", tokenizer_dir=None, checkpoint=None) -> GenerationBackend:
    """The engine of `backend` over `model` (a GPTModel stage built from `model_cfg`, possibly wrapped).
    `batch_size`: prompts per forward batch (megatron), requests in flight (TensorRT-LLM); `decode`:
    the megatron engine's decode path; `tokenizer_dir` and `checkpoint` (an aligner checkpoint the model
    came from, for its Hugging Face architecture) go into TensorRT-LLM's export."""
    eos, pad = (tokenizer.eos_token_id, tokenizer.pad_token_id) if tokenizer is not None else (None, None)
    if backend == "megatron":
        from aligner.generation.megatron_engine import MegatronEngine  # one backend only (see above)

        return MegatronEngine(model, model_cfg, vocab_size, eos_id=eos, pad_id=pad, tokenizer=tokenizer,
                              max_batch_size=batch_size, decode=str(decode))
    if backend == "trtllm":
        return JobTensorRTLLM(model, model_cfg, vocab_size, eos, pad, batch_size, tokenizer_dir, checkpoint)
    raise ValueError(f"unknown generation backend {backend!r}; expected megatron or trtllm")


class JobTensorRTLLM:
    """GenerationBackend: one TensorRT-LLM engine for the job, fed from the trainer's weights (module doc)."""

    def __init__(self, model, model_cfg, vocab_size: int, eos_id: Optional[int], pad_id: Optional[int],
                 batch_size: int, tokenizer_dir=None, checkpoint=None):
        require("tensorrt_llm")  # on every rank, before the first step: one line if it cannot load here
        self.model, self.model_cfg, self.vocab_size = model, model_cfg, int(vocab_size)
        self.eos_id, self.pad_id = eos_id, pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self.batch_size, self.tokenizer_dir, self.checkpoint = int(batch_size), tokenizer_dir, checkpoint
        self.engine = None  # started by the first generate
        self.asleep = False  # its memory released (`sleep`) until the next generate or refit
        self._export = None  # rank 0's temporary Hugging Face directory, kept while the engine lives

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: Optional[Sequence[int]] = None) -> Rollout:
        """Collective over every rank (each with its replica's prompts); returns this replica's rollout."""
        if self.engine is None:
            self._start()
        self.wake()
        prompts = [list(map(int, p)) for p in prompts]
        seeds = list(seeds) if seeds is not None else [rng.derive_seed(params.seed, i) for i in range(len(prompts))]
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        return generate_on_rank0(self.engine, prompts, params, seeds, self.pad_id)

    def refit(self, weight_stream: Optional[WeightStream] = None) -> None:
        """Collective: the live weights (or `weight_stream`) into the engine. Before the first generate
        there is nothing to do: the engine starts from the live weights."""
        if self.engine is None:
            return
        self.wake()  # its weights resident again before they are overwritten
        from aligner.models.weight_stream import iter_hf_weights  # imports megatron (see above)

        self.engine.refit(weight_stream if weight_stream is not None else
                          iter_hf_weights(self.model, self.model_cfg, self.vocab_size, all_ranks=True))

    def refit_check(self, trainer_model=None) -> dict:
        """TensorRT-LLM's weights cannot be read back to compare: config validation refuses
        generation.check_refit with this backend, so no loop gets here."""
        raise NotImplementedError(TRTLLM_NO_REFIT_CHECK)

    def sleep(self) -> None:
        """Collective: the engine's KV cache and weights released while the trainer computes (the RL loops call
        it once their step's generation is done); the next generate or refit wakes it."""
        if self.engine is not None and not self.asleep:
            if dist.get_rank() == 0:
                self.engine.sleep()
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            if dist.get_rank() == 0:
                self.engine.wake()
            self.asleep = False

    def _start(self) -> None:
        """Export the live weights as a Hugging Face directory (collective; rank 0 writes) and start the engine."""
        from aligner.generation.trtllm_engine import TensorRTLLMEngine  # one backend only (see above)

        path = None
        if dist.get_rank() == 0:
            self._export = tempfile.TemporaryDirectory(prefix="aligner-trtllm-")
            path = Path(self._export.name) / "hf"
        export_hf(self.model, self.model_cfg, self.vocab_size, path, self.tokenizer_dir, self.checkpoint)
        self.engine = TensorRTLLMEngine(str(path or ""), tensor_parallel_size=self.model_cfg.tensor_model_parallel_size,
                                        eos_id=self.eos_id, pad_id=self.pad_id, max_batch_size=self.batch_size,
                                        max_seq_len=int(self.model_cfg.seq_length))
        collectives.wait_for_rank(0)  # rank 0 loads the model into TensorRT-LLM (minutes at 70B and more)


def generate_on_rank0(engine, prompts: list[list[int]], params: SamplingParams, seeds: list[int],
                      pad_id: int) -> Rollout:
    """Collective over every rank, each with its data-parallel replica's prompts and seeds: global rank 0's
    `engine` generates every replica's prompts in one call (the other ranks' `engine` is not used), and each
    rank gets its replica's rollout back."""
    replica, first = _replica()
    requests = collectives.all_gather_object((replica, prompts, seeds) if first else (replica, None, None))
    answers = None
    if dist.get_rank() == 0:
        asked = {r: (p, s) for r, p, s in requests if p is not None}
        order = sorted(asked)
        every = [p for r in order for p in asked[r][0]]
        rollout = engine.generate(every, params, [s for r in order for s in asked[r][1]]) if every else Rollout(
            [], torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, 1),
            torch.zeros(0, dtype=torch.bool), [], pad_id)
        parts, start = {}, 0
        for r in order:
            parts[r] = _rows(rollout, start, start + len(asked[r][0]))
            start += len(asked[r][0])
        answers = [parts[r] for r, _, _ in requests]
    collectives.wait_for_rank(0)  # however long rank 0 generates for the job
    return collectives.scatter_object(answers, src=0)


def export_hf(model, model_cfg, vocab_size: int, out_dir, tokenizer_dir=None, checkpoint=None) -> None:
    """Collective: `model`'s weights as a Hugging Face directory at `out_dir`, written by rank 0 (`out_dir`
    is read there only). The architecture and token ids are those `checkpoint` was imported with, if any."""
    from aligner.models.weight_stream import iter_hf_weights  # imports megatron (see above)

    buckets = iter_hf_weights(model, model_cfg, vocab_size)
    if dist.get_rank() != 0:
        for _ in buckets:  # take part in the stream
            pass
        return
    hf = (read_metadata(checkpoint).get("hf") or {}) if checkpoint else {}
    config = hw.hf_config_from_model(model_cfg, vocab_size, hf.get("architecture"), str(model_cfg.params_dtype),
                                     base=hf.get("config"))
    write_hf_dir(out_dir, config, buckets, tokenizer_dir, hf.get("generation_config"))


def _replica() -> tuple[int, bool]:
    """(this rank's replica, whether it is the replica's first rank: TP and PP rank 0). A replica is a
    data-parallel rank with its context-parallel rank: each CP rank asks for prompts of its own (the loops
    split them over DP x CP)."""
    from megatron.core import parallel_state as ps  # see above

    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True), first


def _rows(rollout: Rollout, start: int, stop: int) -> Rollout:
    """Samples start..stop-1 of a rollout."""
    return Rollout(prompt_ids=rollout.prompt_ids[start:stop], response_ids=rollout.response_ids[start:stop],
                   response_lengths=rollout.response_lengths[start:stop], logprobs=rollout.logprobs[start:stop],
                   is_end=rollout.is_end[start:stop], stop_reason=rollout.stop_reason[start:stop],
                   pad_id=rollout.pad_id, info=dict(rollout.info))
