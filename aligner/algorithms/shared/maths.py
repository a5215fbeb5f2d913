"""Pure tensor maths shared by the families. No distributed calls, no model calls.

Conventions: `mask` is 1.0 for tokens that count and 0.0 otherwise; token tensors are [batch, seq].
"""
from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (float32 accumulation)."""
    return (values.float() * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked tokens; 0 when the mask is empty (nothing to average, no NaN)."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


def token_nll_sum(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the masked tokens. The trainer divides by the number of
    loss tokens in the whole global batch, so the loss is a per-token mean that does not depend on
    the micro-batch or data-parallel split (NeMo-RL's convention)."""
    return -masked_sum(token_logprobs, mask)
