"""Rollout data types and the generation-backend protocol.

Conventions (every backend follows them):
  * A response is the generated tokens only (no prompt). A stop token (eos or one of
    `stop_token_ids`) that ended a sample is part of its response, with its log-prob; a sample
    stopped by a stop string keeps every token up to and including the one that completed it.
  * `logprobs[i, j]` is log q(response[i, j] | prompt, response[:j]) under the distribution the
    engine actually sampled from (see `aligner.generation.sampling`); 0 past the response length.
  * Seeds are per sample: the same (model, prompt, params, seed) gives the same response in any
    batch, at any batch position, with any batch size (up to float rounding of the logits).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

# stop reasons, per sample
STOP_EOS = "eos"  # the engine's eos token
STOP_TOKEN = "stop_token"  # one of SamplingParams.stop_token_ids
STOP_STRING = "stop_string"  # the decoded response contains one of SamplingParams.stop_strings
STOP_LENGTH = "length"  # max_new_tokens reached without a stop (is_end False)
STOP_REASONS = (STOP_LENGTH, STOP_EOS, STOP_TOKEN, STOP_STRING)  # code i <-> STOP_REASONS[i]

# MegatronEngine's decode paths: auto (lean when the model qualifies, else megatron), lean (plain torch
# ops), compiled (lean with torch.compile'd decode steps, TP=1), megatron (megatron's own forward)
DECODE_MODES = ("auto", "lean", "compiled", "megatron")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Order of the transforms: temperature, then top-k, then top-p (as in Hugging Face).
    `greedy=True` (or temperature 0) takes the argmax and ignores temperature/top-k/top-p; its
    log-probs are then under the model's own distribution (temperature 1, no filtering).
    `top_k=0` and `top_p=1.0` disable those filters. `min_new_tokens` forbids eos and the stop
    tokens until that many tokens were generated. `seed` derives per-sample seeds when
    `generate` is not given explicit ones (sample i of the call gets seed (seed, i)).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    min_new_tokens: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(str(s) for s in self.stop_strings))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain the empty string")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    def replace(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class Rollout:
    """A batch of generated samples, in prompt order. Tensors live on the engine's device.

    response_ids [N, T] right-padded with `pad_id`; response_lengths [N]; logprobs [N, T] float32
    (0 in padding); is_end [N] True when the sample stopped (eos / stop token / stop string),
    False when it was cut at max_new_tokens; stop_reason[i] one of STOP_REASONS.
    """

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    response_lengths: torch.Tensor
    logprobs: torch.Tensor
    is_end: torch.Tensor
    stop_reason: list[str]
    pad_id: int = 0
    info: dict = field(default_factory=dict)  # timings and counters from the engine

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def responses(self) -> list[list[int]]:
        """Response token ids per sample, without padding."""
        ids, lengths = self.response_ids.tolist(), self.response_lengths.tolist()
        return [row[:n] for row, n in zip(ids, lengths)]

    def response_logprobs(self) -> list[list[float]]:
        lps, lengths = self.logprobs.tolist(), self.response_lengths.tolist()
        return [row[:n] for row, n in zip(lps, lengths)]

    def mask(self) -> torch.Tensor:
        """[N, T] bool, True on response tokens."""
        steps = torch.arange(self.response_ids.shape[1], device=self.response_ids.device)
        return steps[None, :] < self.response_lengths[:, None]

    @staticmethod
    def concat(parts: Sequence["Rollout"], pad_id: int = 0) -> "Rollout":
        """Join rollouts (in order), padding responses to the longest."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.response_ids.shape[1] for p in parts)

        def pad(t, value):
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        return Rollout(
            prompt_ids=[ids for p in parts for ids in p.prompt_ids],
            response_ids=torch.cat([pad(p.response_ids, pad_id) for p in parts]),
            response_lengths=torch.cat([p.response_lengths for p in parts]),
            logprobs=torch.cat([pad(p.logprobs, 0.0) for p in parts]),
            is_end=torch.cat([p.is_end for p in parts]),
            stop_reason=[r for p in parts for r in p.stop_reason],
            pad_id=pad_id,
            info={k: sum(p.info.get(k, 0) for p in parts) for k in parts[0].info})


# A weight stream: buckets of {parameter name: tensor}; see `GenerationBackend.refit`.
WeightStream = Iterable[Mapping[str, torch.Tensor]]


@runtime_checkable
class GenerationBackend(Protocol):
    """What the RL trainers need from a rollout engine (megatron in-process, TensorRT-LLM, ...)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: Optional[Sequence[int]] = None) -> Rollout:
        """Generate one response per prompt (token ids). Collective over the model-parallel group."""
        ...

    def refit(self, weight_stream: Optional[WeightStream] = None) -> None:
        """Bring the engine's weights up to date with the trainer's (from `weight_stream` if given)."""
        ...

    def refit_check(self, trainer_model=None) -> dict:
        """Compare the engine's weights with `trainer_model`'s (`generation.check_refit`). Collective.
        {"shared": same storage, "bitwise": equal bit for bit, "max_abs_diff": float, "params": int}."""
        ...

    def sleep(self) -> None:
        """Release memory the engine holds between generate calls (KV cache, copies) while the trainer
        computes; the next generate or refit wakes it."""
        ...

    def wake(self) -> None:
        """Undo `sleep` (generate and refit do it themselves)."""
        ...
