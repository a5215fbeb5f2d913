"""Trainer-side log-probs of rollout tokens under the engine's sampling distribution.

`sampling_logprobs(local_logits, tokens, params, vocab_size)` gives log q(token) with q as defined in
`aligner.generation.sampling` (temperature, top-k, top-p), from tensor-parallel vocab-sharded logits
[..., V/TP], differentiably. Temperature alone is vocab-parallel (no gather). Top-k / top-p need the
whole row, so the logits are all-gathered over TP (autograd-aware), filtered, and this rank's slice is
taken back; the `min_new_tokens` ban is not reproduced (it only touches the first tokens of a response).
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from aligner.generation.sampling import filter_logits
from aligner.generation.types import SamplingParams
from aligner.models.logprobs import vocab_parallel_logprobs


def _tp():
    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return 1, 0


def filtered_local_logits(local_logits: torch.Tensor, params: SamplingParams, vocab_size: int) -> torch.Tensor:
    """This TP rank's slice [..., V/TP] of the temperature/top-k/top-p filtered logits (float32)."""
    if params.is_greedy:
        return local_logits.float()
    if params.top_k == 0 and params.top_p >= 1.0:
        return local_logits.float() / params.temperature
    tp, rank = _tp()
    full = local_logits
    if tp > 1:
        full = gather_from_tensor_model_parallel_region(local_logits)
    padded = full.shape[-1]
    kept = filter_logits(full[..., :vocab_size], params)
    if padded > vocab_size:  # padding columns stay out of the softmax
        kept = torch.nn.functional.pad(kept, (0, padded - vocab_size), value=float("-inf"))
    return kept.chunk(tp, dim=-1)[rank] if tp > 1 else kept


def sampling_logprobs(local_logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                      vocab_size: int) -> torch.Tensor:
    """log q(tokens) [...] from vocab-parallel logits [..., V/TP] (global token ids)."""
    return vocab_parallel_logprobs(filtered_local_logits(local_logits, params, vocab_size), tokens, vocab_size)
