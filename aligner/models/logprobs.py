"""Log-probabilities and entropy from vocab-parallel logits, never gathering the vocabulary.

Logits arrive split over tensor-parallel ranks along the last dimension ([..., V/TP] each).
Each function communicates only [...]-shaped reductions over the TP group. Columns at or past
`vocab_size` (megatron's padding rows) are excluded from the softmax.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_group():
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    return None, 0


def _all_reduce(t, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _shifted_softmax(logits, vocab_size, group, rank):
    """Returns (z = logits - global max, p = softmax, log Z, first global column id)."""
    local_vocab = logits.shape[-1]
    start = rank * local_vocab
    logits = logits.float()
    if vocab_size is not None and start + local_vocab > vocab_size:
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, float("-inf"))
    maximum = _all_reduce(logits.max(dim=-1, keepdim=True).values.detach(), dist.ReduceOp.MAX, group)
    z = logits - maximum
    exp_z = z.exp()
    sum_exp = _all_reduce(exp_z.sum(-1, keepdim=True), dist.ReduceOp.SUM, group)
    return z, exp_z.div_(sum_exp), sum_exp.log(), start


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size):
        group, rank = _tp_group()
        z, probs, log_z, start = _shifted_softmax(logits, vocab_size, group, rank)
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1])
        picked = z.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        picked = _all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(probs, local, mine)
        ctx.dtype = logits.dtype
        return picked - log_z.squeeze(-1)

    @staticmethod
    def backward(ctx, grad):
        probs, local, mine = ctx.saved_tensors
        # d logp(t) / d z_j = 1[j == t] - p_j
        grad_logits = -probs
        rows = mine.nonzero(as_tuple=True)
        grad_logits[rows + (local[rows],)] += 1.0
        return (grad_logits * grad.unsqueeze(-1)).to(ctx.dtype), None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, vocab_size):
        group, rank = _tp_group()
        z, probs, log_z, _ = _shifted_softmax(logits, vocab_size, group, rank)
        pz = torch.where(probs > 0, probs * z, torch.zeros_like(z))
        expected_z = _all_reduce(pz.sum(-1, keepdim=True), dist.ReduceOp.SUM, group)
        ctx.save_for_backward(probs, torch.where(probs > 0, z, torch.zeros_like(z)), expected_z)
        ctx.dtype = logits.dtype
        return (log_z - expected_z).squeeze(-1)  # H = log Z - E_p[z]

    @staticmethod
    def backward(ctx, grad):
        probs, z, expected_z = ctx.saved_tensors
        # dH / dz_j = -p_j (z_j - E_p[z])
        return (-probs * (z - expected_z) * grad.unsqueeze(-1)).to(ctx.dtype), None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """log p(target) per position. logits [..., V/TP] (this rank's slice), target [...] global ids."""
    group, _ = _tp_group()
    if group is None or dist.get_world_size(group) == 1:  # the whole vocabulary here: torch's fused log-softmax
        logits = logits.float()
        if vocab_size is not None and logits.shape[-1] > vocab_size:
            logits = logits[..., :vocab_size]
        return logits.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return _VocabParallelLogProbs.apply(logits, target, vocab_size)


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Entropy of the softmax per position, in nats. logits [..., V/TP]."""
    return _VocabParallelEntropy.apply(logits, vocab_size)
