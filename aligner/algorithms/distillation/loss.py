"""Pure tensor maths of knowledge distillation on the teacher's top-k support. No distributed calls.

Conventions: per-token tensors are [batch, seq(, K)]; `mask` is 1.0 for the tokens that count. The
teacher's K most likely token ids at a position form the support; `teacher_logits` [..., K] are its
logits there, `student_logits` [..., K] the student's logits at the same ids (gathered vocab-parallel
by the caller, `aligner.models.logprobs.vocab_parallel_gather`).
"""
from __future__ import annotations

import torch

KD_LOSSES = ("fwd_kl", "bwd_kl")


def topk_kd_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, loss: str = "fwd_kl",
                       student_scale: float = 1.0, teacher_scale: float = 1.0) -> torch.Tensor:
    """Per-token divergence between teacher and student, NeMo-Aligner's top-k KD definition
    (`_TopKLogitsCrossEntropy`, with `logits_scale` / `target_logits_scale`).

    Both distributions are renormalised over the K support ids, after scaling the logits:
        q = softmax(teacher_scale * teacher_logits),  p = softmax(student_scale * student_logits)
    * fwd_kl: KL(q || p) = sum_k q_k (log q_k - log p_k)   (forward KL: the student covers the
      teacher's modes; Hinton et al. 2015 without the T^2 factor, as in NeMo-Aligner)
    * bwd_kl: KL(p || q) = sum_k p_k (log p_k - log q_k)   (reverse KL: mode seeking, as in MiniLLM,
      Gu et al. 2024)
    A scale is an inverse temperature (scale = 1/T). Returns float32 [...] (>= 0, 0 where p == q);
    the teacher is a constant (no gradient flows into `teacher_logits`)."""
    if loss not in KD_LOSSES:
        raise ValueError(f"loss must be one of {', '.join(KD_LOSSES)}, got {loss!r}")
    log_p = torch.log_softmax(student_scale * student_logits.float(), dim=-1)
    log_q = torch.log_softmax(teacher_scale * teacher_logits.detach().float(), dim=-1)
    if loss == "fwd_kl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def kd_objective(divergence: torch.Tensor, label_logprobs: torch.Tensor, mask: torch.Tensor, loss_weight: float,
                 sft_loss_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, kd, nll) summed over the masked tokens, with
        loss = loss_weight * sum(divergence) + sft_loss_weight * sum(-label_logprobs)
    `label_logprobs` are the student's log-probs of the data's next tokens over the whole vocabulary
    (unscaled: the SFT term is the student's likelihood). The caller divides every sum by the global
    number of loss tokens (the trainer's per-token convention), where NeMo-Aligner averages per
    micro-batch; the two agree when every micro-batch has as many loss tokens."""
    kd = (divergence.float() * mask).sum()
    nll = -(label_logprobs.float() * mask).sum()
    return loss_weight * kd + sft_loss_weight * nll, kd, nll
