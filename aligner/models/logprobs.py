"""Log-probabilities, entropy, top-k and logits at given ids from vocab-parallel logits, never
gathering the vocabulary.

Logits arrive split over tensor-parallel ranks along the last dimension ([..., V/TP] each).
Each function communicates only [...]-shaped reductions (or k candidates per position) over the TP
group. Columns at or past `vocab_size` (megatron's padding rows) are excluded from the softmax.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

from aligner.runtime import collectives


def _tp_group():
    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    return None, 0


def _all_reduce(t, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        collectives.all_reduce(t, op=op, group=group)
    return t


def _without_padding(logits, vocab_size, start):
    """float32 logits with megatron's padding columns (global ids >= vocab_size) at -inf."""
    local_vocab = logits.shape[-1]
    logits = logits.float()
    if vocab_size is not None and start + local_vocab > vocab_size:
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, float("-inf"))
    return logits


def _shifted_softmax(logits, vocab_size, group, rank):
    """Returns (z = logits - global max, p = softmax, log Z, first global column id)."""
    start = rank * logits.shape[-1]
    logits = _without_padding(logits, vocab_size, start)
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
        grad_logits = -probs  # + 1 at this rank's targets (+ 0 elsewhere: no host-side count of them)
        at = local.clamp(0, probs.shape[-1] - 1).unsqueeze(-1)
        grad_logits.scatter_add_(-1, at, mine.unsqueeze(-1).to(grad_logits.dtype))
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
    if _whole_vocabulary():  # torch's fused log-softmax
        return _log_softmax(logits, vocab_size).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return _VocabParallelLogProbs.apply(logits, target, vocab_size)


def _whole_vocabulary() -> bool:
    """Whether this rank holds the whole vocabulary (no tensor parallelism)."""
    group, _ = _tp_group()
    return group is None or dist.get_world_size(group) == 1


def _log_softmax(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """float32 log-softmax over the whole vocabulary, megatron's padding columns left out."""
    logits = logits.float()
    if vocab_size is not None and logits.shape[-1] > vocab_size:
        logits = logits[..., :vocab_size]
    return logits.log_softmax(-1)


def vocab_parallel_logprobs_and_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int | None = None,
                                        entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per position, the entropy differentiable only with `entropy_grad`. With the
    whole vocabulary here and no entropy gradient both come from one log-softmax, the entropy as
    sum(entr(p)) = -sum p log p (entr(0) = 0 for filtered columns): three passes over the logits, where
    `vocab_parallel_entropy`'s own softmax takes about ten."""
    if entropy_grad or not _whole_vocabulary():
        logprobs = vocab_parallel_logprobs(logits, target, vocab_size)
        with torch.enable_grad() if entropy_grad else torch.no_grad():
            return logprobs, vocab_parallel_entropy(logits, vocab_size)
    log_p = _log_softmax(logits, vocab_size)
    with torch.no_grad():
        entropy = torch.special.entr(log_p.exp()).sum(-1)
    return log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1), entropy


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Entropy of the softmax per position, in nats. logits [..., V/TP]."""
    return _VocabParallelEntropy.apply(logits, vocab_size)


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits per position and their global ids, (values float32 [..., k], ids int64
    [..., k]), largest first. Each TP rank takes the top k of its slice (padding columns excluded);
    the TP ranks' k candidates (k x TP per position, never the vocabulary) are all-gathered and the
    top k of them kept, which is the top k of the whole vocabulary."""
    group, rank = _tp_group()
    start = rank * logits.shape[-1]
    values, ids = _without_padding(logits, vocab_size, start).topk(min(k, logits.shape[-1]), dim=-1)
    ids = ids + start
    if group is None or dist.get_world_size(group) == 1:
        return values, ids
    all_values, all_ids = collectives.all_gather(values, group=group), collectives.all_gather(ids, group=group)
    values, pick = torch.cat(all_values, -1).topk(k, dim=-1)
    return values, torch.cat(all_ids, -1).gather(-1, pick)


def vocab_parallel_gather(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The logits at global token `ids` [..., K] from vocab-parallel `logits` [..., V/TP], as float32
    [..., K]; differentiable. Each TP rank reads the ids in its vocabulary range (0 elsewhere) and an
    all-reduce over the TP group sums the parts; its backward is the identity, so each rank's
    gradient reaches only the columns it owns (megatron's `reduce_from_tensor_model_parallel_region`)."""
    group, rank = _tp_group()
    local_vocab = logits.shape[-1]
    local = ids - rank * local_vocab
    mine = (local >= 0) & (local < local_vocab)
    picked = logits.float().gather(-1, local.clamp(0, local_vocab - 1))
    picked = torch.where(mine, picked, torch.zeros_like(picked))
    if group is None or dist.get_world_size(group) == 1:
        return picked
    return reduce_from_tensor_model_parallel_region(picked)
