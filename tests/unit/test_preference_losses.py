"""The preference losses of `aligner.algorithms.preference.maths`, pinned with hand-computed values.

Two pairs are used throughout, with beta = 0.5:
  pair 0: policy (chosen, rejected) = (-1, -2), reference (-1.5, -1.5) -> delta = 1,  beta delta = 0.5
  pair 1: policy (-3, -1),                      reference (-2, -2)     -> delta = -2, beta delta = -1
and the rewards (chosen, rejected) = (2, 1) and (0, 1) for the reward-aware losses.
"""
import math

import pytest
import torch

from aligner.algorithms.preference import maths
from aligner.models.forward_step import index_sums

POLICY_C, POLICY_R = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
REF_C, REF_R = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
REWARD_C, REWARD_R = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
BETA = 0.5


def softplus(x):  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


def sig(x):
    return 1 / (1 + math.exp(-x))


def dpo(loss_type, **kwargs):
    return maths.dpo_loss(POLICY_C, POLICY_R, REF_C, REF_R, BETA, loss_type, **kwargs).tolist()


def test_sigmoid_dpo_and_cdpo():
    # -log s(0.5) = log(1 + e^-0.5) = 0.474077;  -log s(-1) = log(1 + e) = 1.313262
    assert dpo("sigmoid") == pytest.approx([0.4740770, 1.3132617], abs=1e-6)
    # cDPO, eps = 0.1: 0.9 * 0.474077 + 0.1 * log(1 + e^0.5) = 0.9 * 0.474077 + 0.1 * 0.974077
    assert dpo("sigmoid", label_smoothing=0.1) == pytest.approx(
        [0.9 * 0.4740770 + 0.1 * 0.9740770, 0.9 * 1.3132617 + 0.1 * 0.3132617], abs=1e-6)


def test_robust_dpo():
    # [(1 - eps) softplus(-z) - eps softplus(z)] / (1 - 2 eps), eps = 0.1
    assert dpo("robust", label_smoothing=0.1) == pytest.approx(
        [(0.9 * 0.4740770 - 0.1 * 0.9740770) / 0.8, (0.9 * 1.3132617 - 0.1 * 0.3132617) / 0.8], abs=1e-6)
    assert dpo("robust") == pytest.approx(dpo("sigmoid"))


def test_hinge_and_ipo():
    assert dpo("hinge") == pytest.approx([0.5, 2.0])  # max(0, 1 - beta delta)
    assert dpo("ipo") == pytest.approx([0.0, 9.0])  # (delta - 1/(2 beta))^2 = (1 - 1)^2, (-2 - 1)^2


def test_reward_aware_losses():
    # target g = reward_scale * (r_c - r_r) = 1 and -1; p = s(beta delta) = s(0.5), s(-1)
    rewards = dict(chosen_rewards=REWARD_C, rejected_rewards=REWARD_R)
    assert dpo("rpo_sq", **rewards) == pytest.approx([(0.5 - 1) ** 2, (-1 + 1) ** 2])
    assert dpo("rpo_sq", reward_scale=2.0, **rewards) == pytest.approx([(0.5 - 2) ** 2, (-1 + 2) ** 2])

    def kl(a, b):  # Bernoulli KL(a || b)
        return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))

    p, q = [sig(0.5), sig(-1.0)], [sig(1.0), sig(-1.0)]
    assert dpo("rpo_bwd_kl", **rewards) == pytest.approx([kl(q[0], p[0]), kl(q[1], p[1])], abs=1e-6)
    assert dpo("rpo_fwd_kl", **rewards) == pytest.approx([kl(p[0], q[0]), kl(p[1], q[1])], abs=1e-6)
    assert dpo("rpo_bwd_kl", **rewards)[0] == pytest.approx(0.0263446, abs=1e-6)  # 0.117565 - 0.091221
    assert dpo("rpo_bwd_kl", **rewards)[1] == pytest.approx(0.0, abs=1e-7)  # rewards agree with the policy
    with pytest.raises(ValueError, match="needs chosen_rewards"):
        dpo("rpo_sq")


def test_dpo_is_ln2_when_policy_equals_reference():
    logps = torch.tensor([-3.0, -10.0, -0.5])
    other = torch.tensor([-4.0, -2.0, -7.5])
    loss = maths.dpo_loss(logps, other, logps, other, beta=0.1)
    assert loss.tolist() == pytest.approx([math.log(2)] * 3, abs=1e-7)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = POLICY_C.clone().requires_grad_(), POLICY_R.clone().requires_grad_()
    maths.dpo_loss(chosen, rejected, REF_C, REF_R, BETA).sum().backward()
    # d/d pi_c of -log s(beta delta) = -beta (1 - s(beta delta))
    assert chosen.grad.tolist() == pytest.approx([-BETA * (1 - sig(0.5)), -BETA * (1 - sig(-1.0))], abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([BETA * (1 - sig(0.5)), BETA * (1 - sig(-1.0))], abs=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        dpo("nope")
    with pytest.raises(ValueError, match="label_smoothing applies"):
        dpo("hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        dpo("sigmoid", label_smoothing=0.5)


def test_orpo_hand_computed():
    # log odds(-0.5) = -0.5 - log(1 - e^-0.5) = 0.432752; log odds(-1) = -1 - log(1 - e^-1) = -0.541325
    # ratio term: -log s(0.974077) = 0.320299; loss = 0.5 + 0.1 * 0.320299
    loss = maths.orpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), 0.1)
    assert maths.log_odds(torch.tensor([-0.5, -1.0])).tolist() == pytest.approx([0.432752, -0.541325], abs=1e-6)
    assert loss.item() == pytest.approx(0.5 + 0.1 * softplus(-0.974077), abs=1e-6)
    assert loss.item() == pytest.approx(0.532030, abs=1e-6)
    certain = torch.tensor([0.0], requires_grad=True)  # every token at probability 1 in float32
    maths.orpo_loss(certain, torch.tensor([-1.0]), 0.1).sum().backward()
    assert torch.isfinite(certain.grad).all()


def test_simpo_hand_computed():
    # beta (c - r) - gamma = 2 * 0.5 - 0.5 = 0.5
    c, r = torch.tensor([-0.5, -1.0]), torch.tensor([-1.0, -0.5])
    assert maths.simpo_loss(c, r, beta=2.0, gamma=0.5).tolist() == pytest.approx([0.4740770, softplus(1.5)], abs=1e-6)
    smoothed = maths.simpo_loss(c, r, beta=2.0, gamma=0.5, label_smoothing=0.2)[0].item()
    assert smoothed == pytest.approx(0.8 * softplus(-0.5) + 0.2 * softplus(0.5), abs=1e-6)


def test_kto_hand_computed():
    policy, ref = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0])  # r = 1 (desirable), -1 (undesirable)
    desirable = torch.tensor([True, False])
    loss = maths.kto_loss(policy, ref, desirable, torch.tensor(0.5), beta=1.0, desirable_weight=2.0, undesirable_weight=1.0)
    # 2 (1 - s(1 - 0.5)) = 0.755082;  1 (1 - s(0.5 + 1)) = 0.182426
    assert loss.tolist() == pytest.approx([2 * (1 - sig(0.5)), 1 - sig(1.5)], abs=1e-6)
    assert loss.tolist() == pytest.approx([0.755082, 0.182426], abs=1e-6)
    at_reference = maths.kto_loss(ref, ref, desirable, torch.tensor(0.0), beta=0.1)
    assert at_reference.tolist() == pytest.approx([0.5, 0.5])
    # z0 = max(0, mean log-ratio); detached
    gap = torch.tensor(3.0, requires_grad=True)
    assert maths.kto_kl_estimate(gap, 4).item() == 0.75 and not maths.kto_kl_estimate(gap, 4).requires_grad
    assert maths.kto_kl_estimate(torch.tensor(-3.0), 4).item() == 0.0


def test_sequence_sums_and_accuracy():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    index = torch.tensor([[-1, 0, 0, 2], [1, 1, -1, -1]])  # sequence 2 shares row 0 with sequence 0 (packed)
    sums, counts = index_sums(values, mask, index, 3)
    assert sums.tolist() == [5.0, 11.0, 4.0] and counts.tolist() == [2.0, 2.0, 1.0]
    sums.sum().backward()
    assert torch.equal(values.grad, mask)
    heads = torch.stack([values.detach(), -values.detach()], -1)  # [rows, seq, 2]: per-position vectors
    assert index_sums(heads, mask, index, 3)[0].tolist() == [[5.0, -5.0], [11.0, -11.0], [4.0, -4.0]]
    poisoned = values.detach().masked_fill(mask == 0, float("nan"))  # what masked positions hold is never read
    assert index_sums(poisoned, mask, index, 3)[0].tolist() == [5.0, 11.0, 4.0]
    # no shape that depends on the mask's values (on a GPU the host would wait for the device): the meta
    # device, which has no values, computes it
    meta = index_sums(values.to("meta"), mask.to("meta"), index.to("meta"), 3)
    assert [t.shape for t in meta] == [(3,), (3,)]
    assert maths.preference_accuracy(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 1.0, 2.0])).tolist() == [1, 0, 0.5]
