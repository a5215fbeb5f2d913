"""The top-k knowledge-distillation loss by hand: forward and backward KL, the logit scales, their
gradients, the loss weights and mask, and kd.py's values and loss against the definition in plain Python."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from aligner.algorithms.distillation import loss as kd_loss

LN2, LN3 = math.log(2.0), math.log(3.0)

# One position, K = 2: teacher logits (0, ln 3) -> q = (1/4, 3/4); student logits (0, 0) -> p = (1/2, 1/2).
TEACHER, STUDENT = torch.tensor([0.0, LN3]), torch.tensor([0.0, 0.0])
FWD = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # KL(q || p) = 0.130812
BWD = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(p || q) = 0.143841


def test_forward_and_backward_kl_by_hand():
    assert kd_loss.topk_kd_divergence(STUDENT, TEACHER, "fwd_kl").item() == pytest.approx(0.130812, abs=1e-6)
    assert kd_loss.topk_kd_divergence(STUDENT, TEACHER, "bwd_kl").item() == pytest.approx(0.143841, abs=1e-6)
    assert FWD == pytest.approx(0.130812, abs=1e-6) and BWD == pytest.approx(0.143841, abs=1e-6)
    # equal distributions (a shift of the logits changes nothing) -> 0
    assert kd_loss.topk_kd_divergence(TEACHER + 5.0, TEACHER, "fwd_kl").item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="fwd_kl, bwd_kl"):
        kd_loss.topk_kd_divergence(STUDENT, TEACHER, "jsd")


def test_logit_scales_by_hand():
    # teacher logits (0, 2 ln 3) at scale 1/2 are q = (1/4, 3/4) again
    scaled = kd_loss.topk_kd_divergence(STUDENT, 2 * TEACHER, "fwd_kl", teacher_scale=0.5)
    assert scaled.item() == pytest.approx(FWD, abs=1e-6)
    # student logits (0, ln 3 / 2) at scale 2 are p = q: nothing left to learn
    assert kd_loss.topk_kd_divergence(TEACHER / 2, TEACHER, "bwd_kl", student_scale=2.0).item() == pytest.approx(0.0, abs=1e-6)
    # teacher at scale 0: q uniform = p -> 0; student at scale 2 on (0, ln 3): p = (1/10, 9/10), q = (1/4, 3/4)
    assert kd_loss.topk_kd_divergence(STUDENT, TEACHER, "fwd_kl", teacher_scale=1e-9).item() == pytest.approx(0.0, abs=1e-6)
    expected = 0.25 * math.log(0.25 / 0.1) + 0.75 * math.log(0.75 / 0.9)  # 0.092348
    assert kd_loss.topk_kd_divergence(TEACHER, TEACHER, "fwd_kl", student_scale=2.0).item() == pytest.approx(expected, abs=1e-6)


def test_gradients_by_hand():
    """d KL(q||p) / d s = p - q; d KL(p||q) / d s_j = p_j (log p_j - log q_j - KL(p||q)); the teacher gets none."""
    student, teacher = STUDENT.clone().requires_grad_(True), TEACHER.clone().requires_grad_(True)
    kd_loss.topk_kd_divergence(student, teacher, "fwd_kl").backward()
    assert torch.allclose(student.grad, torch.tensor([0.25, -0.25]), atol=1e-6)
    assert teacher.grad is None or not teacher.grad.any()
    student.grad = None
    kd_loss.topk_kd_divergence(student, teacher, "bwd_kl").backward()
    by_hand = [0.5 * (LN2 - BWD), 0.5 * (math.log(2 / 3) - BWD)]  # (0.274653, -0.274653)
    assert torch.allclose(student.grad, torch.tensor(by_hand), atol=1e-6)
    student.grad = None
    kd_loss.topk_kd_divergence(student, teacher, "fwd_kl", student_scale=2.0).backward()  # 2 (p - q), p = (1/2, 1/2)
    assert torch.allclose(student.grad, torch.tensor([0.5, -0.5]), atol=1e-6)


def test_loss_weights_and_mask_by_hand():
    """Two tokens, the second masked: loss = 2 x kd + 0.5 x nll over the first only."""
    divergence = torch.tensor([[FWD, 5.0]])
    label_logprobs = torch.tensor([[-LN2, math.log(0.1)]])
    loss, kd, nll = kd_loss.kd_objective(divergence, label_logprobs, torch.tensor([[1.0, 0.0]]), 2.0, 0.5)
    assert kd.item() == pytest.approx(0.130812, abs=1e-6) and nll.item() == pytest.approx(LN2, abs=1e-6)
    assert loss.item() == pytest.approx(2 * 0.130812 + 0.5 * 0.693147, abs=1e-5)  # 0.608198


def test_topk_support_against_plain_python():
    """The student's loss on a 7-token vocabulary (one padding column) through kd.py's values and loss,
    against the definition written out with Python floats."""
    from aligner.algorithms.distillation.kd import kd_token_loss, kd_values
    from aligner.models.logprobs import vocab_parallel_topk

    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)
    teacher[..., 7] = 100.0  # a padding column: never in the support
    values, ids = vocab_parallel_topk(teacher, 3, vocab_size=7)
    support = sorted(range(7), key=lambda i: -teacher[0, 0, i].item())[:3]
    assert ids[0, 0].tolist() == support
    local = {"labels": torch.tensor([[4]]), "loss_mask": torch.ones(1, 1), "teacher_ids": ids, "teacher_logits": values,
             "position_ids": torch.zeros(1, 1, dtype=torch.long)}
    cfg = SimpleNamespace(loss="bwd_kl", loss_weight=1.0, sft_loss_weight=1.0, student_logits_scale=1.0,
                          teacher_logits_scale=1.0)
    loss, count, report = kd_token_loss(cfg)(kd_values(7)(student, local), local)
    s, t = [student[0, 0, i].item() for i in support], [teacher[0, 0, i].item() for i in support]
    p = [math.exp(x) / sum(math.exp(y) for y in s) for x in s]
    q = [math.exp(x) / sum(math.exp(y) for y in t) for x in t]
    bwd = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    nll = math.log(sum(math.exp(student[0, 0, i].item()) for i in range(7))) - student[0, 0, 4].item()
    assert report["kd/loss"].item() == pytest.approx(bwd, abs=1e-5)
    assert report["sft/loss"].item() == pytest.approx(nll, abs=1e-5)
    assert loss.item() == pytest.approx(bwd + nll, abs=1e-5) and count.item() == 1
