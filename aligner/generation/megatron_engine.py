"""`MegatronEngine`: rollouts from the trainer's own megatron GPTModel (no weight copy).

Per batch of prompts (right-padded into a slot-indexed [B, S] buffer, slot s = position s):
  1. prefill: `GPTModel.forward(..., inference_context=StaticInferenceContext(B, ...))` over the
     first L0 = min(prompt lengths) slots, which fills megatron's KV cache;
  2. one-token steps from slot L0 on. At slot t a sample whose prompt is longer than t is fed its own
     next prompt token (its prompt is still being consumed, the sampled token is discarded); the
     others are fed the token sampled from the previous step's logits. So every slot of every sample
     holds a real token, positions equal slots, and no attention mask or padding is ever needed.
  Decoding runs either megatron's forward on the same static context (`decode="megatron"`) or
  `LeanDecoder` (`decode="lean"`, the default when the model qualifies), which continues from
  megatron's prefill cache with plain torch ops on the live parameters (see lean_decode.py).

Stops: eos, `stop_token_ids`, `stop_strings` (needs `tokenizer`), `max_new_tokens`; eos and stop
tokens are banned until `min_new_tokens`. The loop ends as soon as every sample has stopped.

Parallelism: under TP every rank runs the forward; the sampler (TP rank 0 of the last stage)
samples and broadcasts the tokens to the TP x PP group. Under PP the stages run in turn for each
step, passing hidden states with send/recv; each stage keeps the KV cache of its own layers only,
so PP needs no extra weight memory (the cost is that one stage works at a time). Every rank returns
the same Rollout. Data-parallel replicas are independent engines (give each its own prompts).

During generate the model is in eval mode under torch.inference_mode, sequence parallelism is
switched off (a decode step has one token per sample) and both are restored afterwards.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional, Sequence

import torch

from aligner.generation import rng, sampling
from aligner.generation.lean_decode import LeanDecoder, unsupported_reason
from aligner.generation.parallel import StageLayout
from aligner.generation.stopping import StopStrings, extract_responses, stop_reasons, stop_token_tensor
from aligner.generation.types import STOP_LENGTH, Rollout, SamplingParams, WeightStream
from aligner.generation.weights import compare_weights, load_weight_stream
from aligner.models.checkpoint import unwrap

_SP_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


class MegatronEngine:
    """GenerationBackend on a megatron GPTModel stage (possibly DDP / Float16Module wrapped).

    model_cfg: the ModelConfig it was built from; vocab_size: the true (unpadded) vocabulary size;
    eos_id: the end-of-sequence token (None: none); pad_id: fills responses past their end
    (default eos_id, else 0); tokenizer: needed for stop strings; max_batch_size: prompts per
    forward batch; decode: "auto" | "lean" | "megatron"; shared: the model is the trainer's own
    (refit is then a no-op and `sleep` keeps the weights in place).
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
        elif decode == "lean" and reason:
            raise ValueError(f"decode='lean' does not support this model ({reason}); use decode='megatron'")
        elif decode not in ("lean", "megatron"):
            raise ValueError(f"decode must be 'auto', 'lean' or 'megatron', got {decode!r}")
        self.decode = decode
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
        if self._home is not None:
            raise RuntimeError("the engine is asleep; call wake() first")
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
        out = gpt(tokens, positions, None, inference_context=context, runtime_gather_output=True)
        context.sequence_len_offset += width
        if not layout.last:
            layout.send_next(out)
            return None
        return out[:, -1, : self.vocab_size].float()

    def _lean_step(self, decoder: LeanDecoder, tokens: torch.Tensor, slot: int) -> torch.Tensor | None:
        layout = self._layout
        if layout.first:
            hidden = decoder.embed(tokens)
        else:
            hidden = layout.recv_prev((tokens.shape[0], self.gpt.config.hidden_size), self._dtype, tokens.device)
        out = decoder.step(hidden, slot)
        if not layout.last:
            layout.send_next(out)
            return None
        return out[:, : self.vocab_size].float()

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> Rollout:
        from megatron.core.inference.contexts import StaticInferenceContext

        layout, device = self._layout, self.device
        self._dtype = next(self.gpt.parameters()).dtype
        batch, lengths = len(prompts), [len(p) for p in prompts]
        shortest, longest = min(lengths), max(lengths)
        max_new, lean = params.max_new_tokens, self.decode == "lean"
        slots = longest + max_new
        buffer = torch.tensor([p + [self.pad_id] * (slots - len(p)) for p in prompts], dtype=torch.int64,
                              device=device)
        prompt_len = torch.tensor(lengths, dtype=torch.int64, device=device)
        slot_logprobs = torch.zeros(batch, slots, dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        generated = torch.zeros(batch, dtype=torch.int64, device=device)
        stop_ids = stop_token_tensor(self.eos_id, params.stop_token_ids, device)
        strings = StopStrings(self.tokenizer, params.stop_strings, batch) if params.stop_strings else None
        sampler = layout.is_sampler
        uniforms = rng.uniform(rng.step_keys(seeds, max_new, device)) if sampler and not params.is_greedy else None
        ban_early = params.min_new_tokens > 0 and stop_ids.numel() > 0

        started = time.perf_counter()
        context = StaticInferenceContext(batch, shortest if lean else slots)
        logits = self._megatron_step(context, buffer[:, :shortest], 0)
        decoder = None
        if lean:
            decoder = LeanDecoder(self.gpt, layout, batch, slots)
            decoder.load_prefix(context, shortest)
            context = None
        prefill_s, steps = time.perf_counter() - started, 0

        with _without_torch_function_modes() if lean else contextlib.nullcontext():
            for t in range(shortest, slots):
                in_prompt = t < longest  # some samples are still being fed their prompt
                if sampler:
                    if in_prompt:
                        index = (t - prompt_len).clamp(0, max_new - 1)  # this step's response index
                        if ban_early and t - longest < params.min_new_tokens:
                            sampling.ban(logits, stop_ids, (t - prompt_len) < params.min_new_tokens)
                        u = uniforms.gather(1, index[:, None]).squeeze(1) if uniforms is not None else None
                    else:
                        r = min(t - shortest, max_new - 1) if shortest == longest else None
                        if ban_early and t - longest < params.min_new_tokens:
                            rows = None if r is not None else (t - prompt_len) < params.min_new_tokens
                            sampling.ban(logits, stop_ids, rows)
                        if uniforms is None:
                            u = None
                        elif r is not None:
                            u = uniforms[:, r]
                        else:
                            u = uniforms.gather(1, (t - prompt_len).clamp(0, max_new - 1)[:, None]).squeeze(1)
                    token, logprob = sampling.sample(logits, params, u)
                    slot_logprobs[:, t] = logprob
                else:
                    token = torch.empty(batch, dtype=torch.int64, device=device)
                layout.from_sampler(token)
                if in_prompt:
                    feeding = t < prompt_len
                    token = torch.where(feeding, buffer[:, t], token)
                    active = ~(done | feeding)
                else:
                    active = ~done
                buffer[:, t] = token
                generated += active
                hit = torch.isin(token, stop_ids) if stop_ids.numel() else torch.zeros_like(done)
                done |= active & (hit | (generated >= max_new))
                if strings is not None:
                    matched = strings.update(token.tolist(), active.tolist())
                    if matched:
                        done[matched] = True
                steps += 1
                if bool(done.all()):
                    break
                if lean:
                    logits = self._lean_step(decoder, token, t)
                else:
                    logits = self._megatron_step(context, token[:, None], t)
        decode_s = time.perf_counter() - started - prefill_s
        del context, decoder

        layout.from_sampler(slot_logprobs)
        ids, logprobs = extract_responses(buffer, slot_logprobs, prompt_len, generated, self.pad_id)
        lengths_out = generated.clone()
        responses = [row[:n] for row, n in zip(ids.tolist(), lengths_out.tolist())]
        reasons = stop_reasons(responses, strings.hit if strings else [False] * batch, self.eos_id,
                               params.stop_token_ids)
        return Rollout(prompt_ids=prompts, response_ids=ids, response_lengths=lengths_out, logprobs=logprobs,
                       is_end=torch.tensor([r != STOP_LENGTH for r in reasons], device=device),
                       stop_reason=reasons, pad_id=self.pad_id,
                       info={"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps,
                             "generated_tokens": int(lengths_out.sum())})


@contextlib.contextmanager
def _without_torch_function_modes():
    """Step outside any TorchFunctionMode (the CPU shims' literal rewriting, see runtime/cpu_shims.py)
    for the lean decode loop, which runs only plain torch ops: every op is then a direct call.
    No mode is active on GPU hosts, so this does nothing there."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

    modes = []
    while _get_current_function_mode_stack():
        modes.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_mode(mode)
