"""Sampling maths on full-vocabulary logits [B, V] (pure functions, no communication).

The sampled distribution q for one step is, in this order:
  1. the model's logits over the true vocabulary (megatron's padding columns dropped),
  2. `ban`: tokens forbidden at this step (eos / stop tokens before `min_new_tokens`) set to -inf,
  3. temperature: logits / T,
  4. top-k: logits below the k-th largest set to -inf (ties with the k-th are kept),
  5. top-p: the smallest set of most likely tokens whose mass reaches p is kept (computed on the
     softmax of step 4's logits; ties with the last kept token are kept), the rest set to -inf,
  q = softmax(result). The token is drawn from q by inversion: the first token whose cumulative
  probability (float64, vocabulary order) exceeds u * total, with one counter-based uniform u per
  sample and step (`aligner.generation.rng`); a token with q = 0 can never be drawn. Its log-prob
  is log q(token): the log-prob UNDER THE DISTRIBUTION ACTUALLY SAMPLED FROM, which is what
  importance weights between trainer and engine need.
  Greedy decoding skips steps 3-5 and takes the argmax; its log-prob is under q = softmax(steps 1-2),
  i.e. the model's own distribution at temperature 1.

The trainer side recomputes the same q from its own (vocab-parallel) logits with
`aligner.generation.trainer_logprobs.sampling_logprobs`.
"""
from __future__ import annotations

import torch

from aligner.generation.types import SamplingParams

NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep logits >= the k-th largest along the last dim; k <= 0 or k >= V keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens until their mass reaches p (at least one)."""
    if p >= 1.0:
        return logits
    ordered = logits.sort(dim=-1, descending=True).values
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
    keep = (mass_before < p).sum(-1, keepdim=True)  # >= 1: mass_before[0] = 0 < p
    threshold = ordered.gather(-1, keep - 1)
    return logits.masked_fill(logits < threshold, NEG_INF)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Steps 3-5 (float32 out). Greedy params return the logits unchanged (as float32)."""
    logits = logits.float()
    if params.is_greedy:
        return logits
    logits = apply_temperature(logits, params.temperature)
    logits = top_k_filter(logits, params.top_k)
    return top_p_filter(logits, params.top_p)


def ban(logits: torch.Tensor, token_ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set columns `token_ids` to -inf, in place, in every row (rows=None) or where `rows` [B] is True."""
    if token_ids.numel() == 0:
        return logits
    if rows is None:
        logits[:, token_ids] = NEG_INF
    else:
        logits[:, token_ids] = logits[:, token_ids].masked_fill(rows[:, None], NEG_INF)
    return logits


def logprob_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row, float32."""
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(-1)


def sample(logits: torch.Tensor, params: SamplingParams,
           uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits [B, V] (bans already applied); uniforms [B] float64 in (0, 1)
    (`rng.uniform`), unused when greedy. Returns (tokens [B] int64, log q(tokens) [B] float32)."""
    q_logits = filter_logits(logits, params)
    if params.is_greedy:
        tokens = q_logits.argmax(-1)
        return tokens, logprob_of(q_logits, tokens)
    probs = q_logits.softmax(-1)
    cdf = probs.cumsum(-1, dtype=torch.float64)
    tokens = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(1)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(1).log()
