"""`MegatronEngine`: rollouts from the trainer's own megatron GPTModel (no weight copy).

Per batch of prompts (right-padded into a slot-indexed [B, S] buffer, slot s = position s):
  1. prefill over the first L0 = min(prompt lengths) slots, which fills the KV cache;
  2. one-token steps from slot L0 on. At slot t a sample whose prompt is longer than t is fed its own
     next prompt token (its prompt is still being consumed, the sampled token is discarded); the
     others are fed the token sampled from the previous step's logits. So every slot of every sample
     holds a real token, positions equal slots, and no attention mask or padding is ever needed.
  Both run either megatron's forward with its `StaticInferenceContext` KV cache (`decode="megatron"`)
  or `LeanDecoder` (`decode="lean"`, the default when the model qualifies): the same maths with
  plain torch ops on the live parameters and a preallocated cache (see lean_decode.py);
  `decode="compiled"` is LeanDecoder with its decode steps compiled by torch.compile (TP=1 only;
  each new batch size or cache capacity costs a compilation, seconds, the first time).

Stops: eos, `stop_token_ids`, `stop_strings` (needs `tokenizer`), `max_new_tokens`; eos and stop
tokens are banned until `min_new_tokens`. The loop ends as soon as every sample has stopped.

Parallelism: under TP every rank runs the forward; the sampler (TP rank 0 of the last stage)
samples and broadcasts the tokens to the TP x PP group. Under PP the stages run in turn for each
step, passing hidden states with send/recv; each stage keeps the KV cache of its own layers only,
so PP needs no extra weight memory (the cost is that one stage works at a time). Every rank returns
the same Rollout. Data-parallel replicas are independent engines (give each its own prompts), and so
is every context-parallel rank: the lean decoder runs whole sequences on a CP rank's whole weights
(megatron's forward, which would split them over the CP ranks, is refused under CP).

During generate everything runs under torch.inference_mode. Megatron's forward runs with the model in
eval mode and sequence parallelism switched off (a decode step has one token per sample), both restored
afterwards; the lean decoder runs no layer's forward (the rotary table's only, which neither changes),
so it skips the switch (a walk over every module, ~1 ms a call on the tiny model).
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional, Sequence

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from aligner.generation import rng, sampling
from aligner.generation.lean_decode import LeanDecoder, unsupported_reason
from aligner.generation.parallel import StageLayout
from aligner.generation.stopping import StopStrings, extract_responses, stop_reasons, stop_token_tensor
from aligner.generation.types import DECODE_MODES, STOP_LENGTH, Rollout, SamplingParams, WeightStream
from aligner.generation.weights import compare_weights, load_weight_stream
from aligner.models.checkpoint import unwrap
from aligner.models.sdpa_attention import all_fused

_SP_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


class MegatronEngine:
    """GenerationBackend on a megatron GPTModel stage (possibly DDP / Float16Module wrapped).

    model_cfg: the ModelConfig it was built from; vocab_size: the true (unpadded) vocabulary size;
    eos_id: the end-of-sequence token (None: none); pad_id: fills responses past their end
    (default eos_id, else 0); tokenizer: needed for stop strings; max_batch_size: prompts per
    forward batch; decode: "auto" | "lean" | "compiled" | "megatron"; shared: the model is the
    trainer's own (refit is then a no-op and `sleep` keeps the weights in place).
    """

    def __init__(self, model, model_cfg, vocab_size: int, eos_id: Optional[int], pad_id: Optional[int] = None,
                 tokenizer=None, max_batch_size: int = 64, decode: str = "auto", shared: bool = True):
        self.model, self.gpt = model, unwrap(model)
        self.model_cfg, self.vocab_size = model_cfg, int(vocab_size)
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self.tokenizer, self.max_batch_size, self.shared = tokenizer, int(max_batch_size), shared
        reason = unsupported_reason(self.gpt)
        if decode == "auto":
            decode = "megatron" if reason else "lean"
        elif decode in ("lean", "compiled") and reason:
            raise ValueError(f"decode={decode!r} does not support this model ({reason}); use decode='megatron'")
        elif decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(map(repr, DECODE_MODES))}, got {decode!r}")
        if decode == "compiled" and model_cfg.tensor_model_parallel_size > 1:
            raise ValueError("decode='compiled' needs tensor_model_parallel_size=1 (TP's all-reduces sit inside "
                             "the layers); use decode='lean' under TP")
        if decode == "megatron" and self.gpt.config.context_parallel_size > 1:
            raise ValueError("decode='megatron' runs megatron's forward, whose attention under context parallelism "
                             "expects a sequence split over the CP ranks, and each CP rank generates whole sequences"
                             + (f"; this model needs it ({reason}), so generate with context_parallel_size=1"
                                if reason else "; use decode='lean'"))
        if decode == "megatron" and all_fused(self.gpt):
            raise ValueError("decode='megatron' does not run on a model with torch's fused attention (the policy "
                             "models of aligner.models.policy); use decode='lean'")
        self.decode = decode
        # Steps between checks that every sample has stopped (each check waits for the device). A few
        # wasted steps at the end are cheaper on a GPU than a sync per step; a CPU has nothing to wait for.
        self.sync_every = 1 if self.device.type == "cpu" else 8
        self._layout: StageLayout | None = None
        self._home = None  # device of the weights while asleep (unshared models only)

    # ----------------------------------------------------------------------------------- protocol
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: Optional[Sequence[int]] = None) -> Rollout:
        """Collective over the TP x PP group; every rank gets the whole Rollout."""
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt {i} has a token id outside [0, {self.vocab_size})")
        if seeds is None:
            seeds = [rng.derive_seed(params.seed, i) for i in range(len(prompts))]
        elif len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to MegatronEngine")
        self.wake()
        if not prompts:
            empty = torch.zeros(0, 1, dtype=torch.int64, device=self.device)
            return Rollout([], empty, empty[:, 0], empty.float(), empty[:, 0].bool(), [], self.pad_id)
        if self._layout is None:
            self._layout = StageLayout.current()
        step = self.max_batch_size
        with self._generation_mode():
            parts = [self._generate_batch(prompts[i:i + step], params, list(seeds[i:i + step]))
                     for i in range(0, len(prompts), step)]
        parts = [self._detach(p) for p in parts]  # usable outside inference mode (e.g. in a loss)
        return Rollout.concat(parts, self.pad_id)

    def refit(self, weight_stream: Optional[WeightStream] = None) -> None:
        """Shared model: nothing to do (generate reads the live parameters). With a stream: copy it in."""
        self.wake()
        if weight_stream is not None:
            load_weight_stream(self.gpt, weight_stream, self.model_cfg, self.vocab_size)

    def refit_check(self, trainer_model=None) -> dict:
        """Compare the engine's weights with `trainer_model`'s (default: the model it was built on),
        vocabulary padding rows excluded. Collective. {"shared", "bitwise", "max_abs_diff", "params"}."""
        return compare_weights(self.gpt, unwrap(trainer_model) if trainer_model is not None else self.gpt,
                               self.vocab_size)

    def sleep(self) -> None:
        """Nothing is cached between calls (KV caches live per call); an unshared model on a GPU
        moves its weights to host memory."""
        if not self.shared and torch.cuda.is_available() and self._home is None:
            self._home = next(self.gpt.parameters()).device
            self.gpt.cpu()
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self._home is not None:
            self.gpt.to(self._home)
            self._home = None

    # ------------------------------------------------------------------------------- internals
    @property
    def device(self) -> torch.device:
        return next(self.gpt.parameters()).device

    @contextlib.contextmanager
    def _generation_mode(self):
        if self.decode != "megatron":  # the lean decoder reads parameters only (module doc)
            with torch.inference_mode():
                yield
            return
        was_training = self.model.training
        config = self.gpt.config
        saved = [(m, a, getattr(m, a)) for m in self.gpt.modules() for a in _SP_ATTRS
                 if isinstance(getattr(m, a, None), bool)]
        saved_sp = config.sequence_parallel
        self.model.eval()
        for module, attr, _ in saved:
            setattr(module, attr, False)
        config.sequence_parallel = False
        try:
            with torch.inference_mode():
                yield
        finally:
            config.sequence_parallel = saved_sp
            for module, attr, value in saved:
                setattr(module, attr, value)
            self.gpt.set_input_tensor(None)
            self.model.train(was_training)

    @staticmethod
    def _detach(rollout: Rollout) -> Rollout:
        for name in ("response_ids", "response_lengths", "logprobs", "is_end"):
            setattr(rollout, name, getattr(rollout, name).clone())
        return rollout

    def _megatron_step(self, context, tokens: torch.Tensor, slot: int) -> torch.Tensor | None:
        """GPTModel.forward of this stage on tokens [B, s] at slots [slot, slot+s) with the static
        KV cache; returns float32 logits [B, V] of the last slot on the last stage, else None."""
        layout, gpt = self._layout, self.gpt
        batch, width = tokens.shape
        if not layout.first:
            gpt.set_input_tensor(layout.recv_prev((width, batch, gpt.config.hidden_size), self._dtype, tokens.device))
        positions = torch.arange(slot, slot + width, device=tokens.device).expand(batch, width)
        if gpt.position_embedding_type == "mrope":  # a policy model reading explicit positions (models/policy.py)
            positions = positions.expand(3, batch, width)
        out = gpt(tokens, positions, None, inference_context=context, runtime_gather_output=True)
        context.sequence_len_offset += width
        if not layout.last:
            layout.send_next(out)
            return None
        return out[:, -1, : self.vocab_size].float()

    def _lean_step(self, decoder: LeanDecoder, tokens: torch.Tensor, slot: int) -> torch.Tensor | None:
        """`LeanDecoder.forward` of this stage on tokens [B, s] at slots [slot, slot+s); as _megatron_step."""
        layout = self._layout
        if layout.first:
            hidden = decoder.embed(tokens)
        else:
            hidden = layout.recv_prev((*tokens.shape, self.gpt.config.hidden_size), self._dtype, tokens.device)
        out = decoder.forward(hidden, slot)
        if not layout.last:
            layout.send_next(out)
            return None
        return out[:, : self.vocab_size].float()

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> Rollout:
        layout, device, lean = self._layout, self.device, self.decode in ("lean", "compiled")
        self._dtype = next(self.gpt.parameters()).dtype
        lengths = [len(p) for p in prompts]
        batch, shortest, longest, max_new = len(prompts), min(lengths), max(lengths), params.max_new_tokens
        slots = longest + max_new
        buffer = torch.tensor([p + [self.pad_id] * (slots - len(p)) for p in prompts], dtype=torch.int64,
                              device=device)
        prompt_len = torch.tensor(lengths, dtype=torch.int64, device=device)
        last_slot = prompt_len + (max_new - 1)  # a sample's response ends at this slot at the latest
        slot_logprobs = torch.zeros(batch, slots, dtype=torch.float32, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # a stop token / string was produced
        stop_ids = stop_token_tensor(self.eos_id, params.stop_token_ids, device)
        strings = StopStrings(self.tokenizer, params.stop_strings, batch) if params.stop_strings else None
        chooser = _TokenChooser(params, seeds, prompt_len, shortest, longest, stop_ids, device) \
            if layout.is_sampler else None

        started = time.perf_counter()
        decoder = LeanDecoder(self.gpt, layout, batch, slots, compiled=self.decode == "compiled") if lean else None
        context = None if lean else StaticInferenceContext(batch, slots)
        # The lean path runs only plain torch ops: step outside any TorchFunctionMode (the CPU shims'
        # literal rewriting, runtime/cpu_shims.py), so that every op is a direct call.
        with torch.DisableTorchFunction() if lean else contextlib.nullcontext():
            if lean:
                logits = self._lean_step(decoder, buffer[:, :shortest], 0)
            else:
                logits = self._megatron_step(context, buffer[:, :shortest], 0)
            prefill_s = time.perf_counter() - started
            for t in range(shortest, slots):
                if chooser is not None:
                    token, logprob = chooser(logits, t)
                    slot_logprobs[:, t] = logprob
                else:
                    token = torch.empty(batch, dtype=torch.int64, device=device)
                token = layout.from_sampler(token)
                feeding = None
                if t < longest:  # samples with longer prompts are fed their own next prompt token
                    feeding = t < prompt_len
                    token = torch.where(feeding, buffer[:, t], token)
                buffer[:, t] = token
                if stop_ids.numel():
                    hit = torch.isin(token, stop_ids)
                    stopped |= hit if feeding is None else hit & ~feeding
                if strings is not None:
                    on = [p <= t <= p + max_new - 1 and not s for p, s in zip(lengths, stopped.tolist())]
                    matched = strings.update(token.tolist(), on)
                    if matched:
                        stopped[matched] = True
                if t == slots - 1:
                    break
                if strings is not None or (t - shortest) % self.sync_every == self.sync_every - 1:
                    finished = stopped if t < shortest + max_new - 1 else stopped | (last_slot <= t)
                    if bool(finished.all()):  # a host sync
                        break
                if lean:
                    logits = self._lean_step(decoder, token[:, None], t)
                else:
                    logits = self._megatron_step(context, token[:, None], t)
        decode_s = time.perf_counter() - started - prefill_s
        del context, decoder

        layout.from_sampler(slot_logprobs)
        response_len = _response_lengths(buffer, prompt_len, stop_ids, max_new, t,
                                          [len(r) if hit else None for r, hit in zip(strings.responses, strings.hit)]
                                          if strings else None)
        ids, logprobs = extract_responses(buffer, slot_logprobs, prompt_len, response_len, self.pad_id)
        responses = [row[:n] for row, n in zip(ids.tolist(), response_len.tolist())]
        reasons = stop_reasons(responses, strings.hit if strings else [False] * batch, self.eos_id,
                               params.stop_token_ids)
        return Rollout(prompt_ids=prompts, response_ids=ids, response_lengths=response_len, logprobs=logprobs,
                       is_end=torch.tensor([r != STOP_LENGTH for r in reasons], device=device),
                       stop_reason=reasons, pad_id=self.pad_id,
                       info={"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": t - shortest + 1,
                             "generated_tokens": int(response_len.sum())})


class _TokenChooser:
    """The sampler's per-step choice: bans before min_new_tokens, this step's uniforms, `sampling.sample`.
    Sample b's response index at slot t is r = t - P_b (negative while its prompt is being fed)."""

    def __init__(self, params: SamplingParams, seeds, prompt_len, shortest: int, longest: int, stop_ids, device):
        self.params, self.prompt_len, self.shortest, self.longest = params, prompt_len, shortest, longest
        self.stop_ids = stop_ids if params.min_new_tokens > 0 else stop_ids[:0]
        self.uniforms = None if params.is_greedy else rng.uniform(rng.step_keys(seeds, params.max_new_tokens, device))

    def __call__(self, logits: torch.Tensor, t: int):
        params, uniform_lengths = self.params, self.shortest == self.longest
        if self.stop_ids.numel() and t - self.longest < params.min_new_tokens:
            rows = None if uniform_lengths else (t - self.prompt_len) < params.min_new_tokens
            sampling.ban(logits, self.stop_ids, rows)
        u = None
        if self.uniforms is not None:
            if uniform_lengths:
                u = self.uniforms[:, min(t - self.shortest, params.max_new_tokens - 1)]
            else:
                index = (t - self.prompt_len).clamp(0, params.max_new_tokens - 1)
                u = self.uniforms.gather(1, index[:, None]).squeeze(1)
        return sampling.sample(logits, params, u)


def _response_lengths(buffer, prompt_len, stop_ids, max_new: int, last_t: int, string_lengths) -> torch.Tensor:
    """Tokens per response: up to and including its first stop token (or the token completing a stop
    string), else max_new; only slots up to `last_t` (the last one generated) count."""
    steps = torch.arange(max_new, device=buffer.device)
    index = prompt_len[:, None] + steps[None, :]
    lengths = torch.full_like(prompt_len, max_new)
    if stop_ids.numel():
        hits = torch.isin(buffer.gather(1, index.clamp(max=buffer.shape[1] - 1)), stop_ids) & (index <= last_t)
        lengths = torch.where(hits.any(1), hits.int().argmax(1) + 1, lengths)
    lengths = torch.minimum(lengths, (last_t + 1 - prompt_len).clamp(min=0))
    if string_lengths is not None:
        cut = torch.tensor([n if n is not None else max_new for n in string_lengths], device=buffer.device)
        lengths = torch.minimum(lengths, cut)
    return lengths

