"""Train/inference mismatch between the trainer's and the engine's log-probs of the same rollout tokens.

Inputs are [N, T] log-probs: `trainer` = log p (the trainer's recomputation, e.g. with
`sampling_logprobs`), `engine` = log q (the rollout engine's, the behaviour policy the tokens were
drawn from), and an optional [N, T] mask of response tokens (None = every entry counts).
Means are over masked tokens of the whole batch (token-level), returned as 0-dim tensors.
"""
from __future__ import annotations

import torch

from aligner.algorithms.shared.maths import masked_mean


def _mask(trainer: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(trainer, dtype=torch.bool) if mask is None else mask.bool()


def token_prob_error(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean over response tokens of exp(|log p - log q|); 1.0 means the two agree exactly."""
    m = _mask(trainer, mask)
    delta = torch.where(m, trainer - engine, torch.zeros_like(trainer))
    return masked_mean(delta.abs().exp(), m)


def kl(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor | None = None,
       estimator: str = "k3") -> torch.Tensor:
    """Token-mean estimate of KL(q || p), q = engine (the sampling distribution), p = trainer.

    With r = p/q = exp(log p - log q) at tokens drawn from q:
      "k1": -log r           (unbiased, high variance, can be negative)
      "k3": (r - 1) - log r  (Schulman's estimator: unbiased and always >= 0; the default)
    """
    m = _mask(trainer, mask)
    log_r = torch.where(m, trainer - engine, torch.zeros_like(trainer))
    if estimator == "k1":
        values = -log_r
    elif estimator == "k3":
        values = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1' or 'k3'")
    return masked_mean(values, m)


def truncated_fraction(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor | None = None,
                       level: str = "token", cap: float = 2.0) -> torch.Tensor:
    """The fraction of masked tokens whose `truncated_is_weights` weight was cut at `cap` (at sequence level,
    every token of a sequence whose weight was)."""
    m = _mask(trainer, mask)
    log_r = torch.where(m, trainer - engine, torch.zeros_like(trainer)).detach().float()
    if level == "sequence":
        log_r = log_r.sum(-1, keepdim=True).expand_as(log_r)
    return masked_mean((log_r > torch.log(torch.tensor(float(cap)))).float(), m)


def truncated_is_weights(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor | None = None,
                         level: str = "token", cap: float = 2.0) -> torch.Tensor:
    """Truncated importance weights w = min(p/q, cap) correcting for sampling from q instead of p.

    level "token":    w_t = min(exp(log p_t - log q_t), cap) per token.
    level "sequence": w = min(exp(sum_t (log p_t - log q_t)), cap), the same for every token of a sequence.
    Returns [N, T] weights (0 outside the mask), without gradient (they scale a loss).
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    m = _mask(trainer, mask)
    log_r = torch.where(m, trainer - engine, torch.zeros_like(trainer)).detach().float()
    log_cap = torch.log(torch.tensor(float(cap), dtype=log_r.dtype, device=log_r.device))
    if level == "token":
        weights = log_r.clamp(max=log_cap).exp()
    elif level == "sequence":
        weights = log_r.sum(-1, keepdim=True).clamp(max=log_cap).exp().expand_as(log_r)
    else:
        raise ValueError(f"unknown level {level!r}; expected 'token' or 'sequence'")
    return weights * m
