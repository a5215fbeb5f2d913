"""The online-RL maths of `aligner.algorithms.online.maths` (KL, rewards, GAE, group advantages, the
clipped policy loss and its aggregations, explained variance), `vocab_parallel_entropy` and
`masked_global_mean_var`, pinned with numbers worked out by hand in the comments."""
import math

import pytest
import torch
import torch.distributed as dist

from aligner.algorithms.online import maths
from aligner.models.logprobs import vocab_parallel_entropy
from aligner.runtime import distributed

NAN = float("nan")


def test_kl_penalty_estimators():
    # d = logprobs - ref = [0.5, -1]
    logprobs, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert maths.kl_penalty(logprobs, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert maths.kl_penalty(logprobs, ref, "k2").tolist() == pytest.approx([0.125, 0.5])  # d^2 / 2
    # exp(-d) - 1 + d: e^-0.5 - 0.5 = 0.1065307, e - 2 = 0.7182818
    assert maths.kl_penalty(logprobs, ref, "k3").tolist() == pytest.approx([0.1065307, 0.7182818], abs=1e-6)
    assert maths.kl_penalty(logprobs, ref, "abs").tolist() == pytest.approx([0.5, 1.0])
    with pytest.raises(ValueError, match="k1, k2, k3, abs"):
        maths.kl_penalty(logprobs, ref, "k4")


def test_token_rewards_kl_on_tokens_score_on_last():
    scores = torch.tensor([2.0, 5.0, 7.0])
    kl = torch.tensor([[NAN, 0.2, 0.3, NAN], [0.4, 0.0, -0.2, 1.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    # kl_coef 0.5: row 0 -> [0, -0.1, -0.15 + 2, 0]; row 1 -> [-0.2, 0, 0.1, -0.5 + 5]; row 2 (empty) -> 0
    expected = [[0.0, -0.1, 1.85, 0.0], [-0.2, 0.0, 0.1, 4.5], [0.0, 0.0, 0.0, 0.0]]
    assert maths.token_rewards(scores, kl, mask, 0.5).tolist() == [pytest.approx(row) for row in expected]


def test_gae_three_tokens_by_hand():
    # positions: prompt, 3 response tokens, padding (junk values and rewards off the mask)
    rewards = torch.tensor([[9.0, 0.5, -0.2, 1.0, 9.0]])
    values = torch.tensor([[9.0, 0.3, 0.6, 0.4, 9.0]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0]])
    # gamma = 0.9, lam = 0.8, gamma lam = 0.72; V after the last token = 0
    # t=3: delta = 1.0 + 0 - 0.4 = 0.6;                A = 0.6
    # t=2: delta = -0.2 + 0.9 * 0.4 - 0.6 = -0.44;    A = -0.44 + 0.72 * 0.6 = -0.008
    # t=1: delta = 0.5 + 0.9 * 0.6 - 0.3 = 0.74;       A = 0.74 + 0.72 * -0.008 = 0.73424
    advantages, returns = maths.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert advantages[0].tolist() == pytest.approx([0.0, 0.73424, -0.008, 0.6, 0.0], abs=1e-6)
    assert returns[0].tolist() == pytest.approx([0.0, 1.03424, 0.592, 1.0, 0.0], abs=1e-6)  # A + V


@pytest.mark.parametrize("middle", [-5.0, 1e3, NAN])
def test_gae_skips_unmasked_tokens_between_response_tokens(middle):
    # [1, 0, 1] (an observation in the middle) equals [1, 1] with the middle removed, in a batch
    # with an ordinary row: rewards [0.5, 1.0], values [0.3, 0.4], gamma 0.9, lam 0.8:
    # A_2 = 1.0 - 0.4 = 0.6; delta_0 = 0.5 + 0.9 * 0.4 - 0.3 = 0.56, A_0 = 0.56 + 0.72 * 0.6 = 0.992
    rewards = torch.tensor([[0.5, middle, 1.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.3, middle, 0.4], [0.0, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 0, 1], [0, 1, 1]])
    advantages, returns = maths.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 1: t=2: A = 1 - 0.5 = 0.5; t=1: delta = 0 + 0.45 - 0.5 = -0.05, A = -0.05 + 0.36 = 0.31
    assert advantages.tolist() == [pytest.approx([0.992, 0.0, 0.6]), pytest.approx([0.0, 0.31, 0.5])]
    assert returns[0].tolist() == pytest.approx([1.292, 0.0, 1.0])
    removed, _ = maths.gae(rewards[:1, [0, 2]], values[:1, [0, 2]], torch.ones(1, 2), gamma=0.9, lam=0.8)
    assert advantages[0, [0, 2]].tolist() == pytest.approx(removed[0].tolist())


# Two groups of three. Group 0: rewards [1, 5, 100], the 100 masked out -> valid {1, 5}, mean 3.
# Group 1: [0.9, 0.9, 0.9], all valid and equal (0.9 - float32 mean(0.9, 0.9, 0.9) = 6e-8, not 0).
REWARDS = torch.tensor([1.0, 5.0, 100.0, 0.9, 0.9, 0.9])
VALID = torch.tensor([True, True, False, True, True, True])


@pytest.mark.parametrize("estimator, expected", [
    ("dr_grpo", [-2.0, 2.0, 0, 0, 0, 0]),
    # unbiased std of {1, 5}: sqrt((4 + 4) / 1) = 2.8284271 -> -+2 / (2.8284271 + 1e-6) = -+0.7071065
    ("grpo", [-0.7071065, 0.7071065, 0, 0, 0, 0]),
    # r minus the other valid sample: 1 - 5, 5 - 1
    ("rloo", [-4.0, 4.0, 0, 0, 0, 0]),
    # batch of the 5 valid rewards {1, 5, 0.9, 0.9, 0.9}: mean 8.7 / 5 = 1.74, deviations
    # [-0.74, 3.26, -0.84 x 3], population variance (0.5476 + 10.6276 + 3 * 0.7056) / 5 = 2.6584,
    # std 1.6304601: -0.74 / 1.6304601 = -0.4538594, ...
    ("reinforce_pp", [-0.4538594, 1.9994344, 0, -0.5151917, -0.5151917, -0.5151917]),
    # group-centred valid values [-2, 2, 0, 0, 0]: population std sqrt(8 / 5) = 1.2649111
    ("reinforce_pp_baseline", [-1.5811376, 1.5811376, 0, 0, 0, 0]),
])
def test_group_advantages_by_hand(estimator, expected):
    advantages = maths.group_advantages(REWARDS, 3, estimator, mask=VALID)
    assert advantages.tolist() == pytest.approx(expected, abs=1e-6)
    if estimator != "reinforce_pp":  # the all-equal group: exactly 0, not 6e-8 / (std + eps)
        assert advantages[3:].abs().max() == 0


def test_group_advantages_rloo_three_valid_and_lone_sample():
    # others' means: (2 + 6) / 2 = 4, (1 + 6) / 2 = 3.5, (1 + 2) / 2 = 1.5
    assert maths.group_advantages(torch.tensor([1.0, 2.0, 6.0]), 3, "rloo").tolist() == pytest.approx([-3.0, -1.5, 4.5])
    # a group with one valid sample has nothing to compare against
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        lone = maths.group_advantages(torch.tensor([4.0, 7.0]), 2, estimator, mask=torch.tensor([1.0, 0.0]))
        assert lone.tolist() == [0.0, 0.0], estimator


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="groups of 4"):
        maths.group_advantages(REWARDS, 4, "grpo")
    with pytest.raises(ValueError, match="grpo, dr_grpo, rloo"):
        maths.group_advantages(REWARDS, 3, "ppo")


# The clipped loss on two sequences of four tokens with ratios [0.5, 1.1, 1.5, 4.0] (old log-probs 0)
# and advantages +1 and -1. Per token, max(-A rho, -A clip(rho, 0.8, 1.2)):
#   A = +1: [max(-0.5, -0.8), -1.1, max(-1.5, -1.2), max(-4, -1.2)] = [-0.5, -1.1, -1.2*, -1.2*]
#   A = -1: [max(0.5, 0.8), 1.1, max(1.5, 1.2), max(4, 1.2)]         = [0.8*, 1.1, 1.5, 4.0]
# (* the clipped term wins: no gradient). Token mean: (-4.0 + 7.4) / 8 = 0.425.
RATIOS = torch.tensor([0.5, 1.1, 1.5, 4.0])
ADVANTAGES = torch.tensor([1.0, -1.0])


def clip_case():
    logprobs = RATIOS.log().repeat(2, 1).requires_grad_()
    return logprobs, torch.zeros(2, 4), torch.ones(2, 4)


def test_policy_loss_clip_gradient_and_metrics():
    logprobs, old, mask = clip_case()
    loss, metrics = maths.policy_loss(logprobs, old, ADVANTAGES, mask)
    assert loss.item() == pytest.approx(0.425)
    # d(-A rho)/d logp = -A rho on unclipped tokens, 0 on clipped ones; / 8 tokens
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad.tolist() == [pytest.approx([-0.5 / 8, -1.1 / 8, 0, 0]), pytest.approx([0, 1.1 / 8, 1.5 / 8, 4.0 / 8])]
    assert metrics["clip_fraction"].item() == pytest.approx(3 / 8)
    assert metrics["dual_clip_fraction"].item() == 0
    # (rho - 1) - log rho: 0.1931472, 0.0046898, 0.0945349, 1.6137056 -> mean 0.4765194
    assert metrics["approx_kl"].item() == pytest.approx(0.4765194, abs=1e-6)
    assert metrics["ratio/mean"].item() == pytest.approx(7.1 / 4)
    assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())
    # token-level advantages equal to the broadcast sequence-level ones give the same loss
    token_level, _ = maths.policy_loss(logprobs, old, ADVANTAGES[:, None].expand(2, 4), mask)
    assert token_level.item() == pytest.approx(0.425)


def test_policy_loss_clip_higher_and_dual_clip():
    logprobs, old, mask = clip_case()
    # clip_high 0.28: A=+1 tokens 3 and 4 become -1.28; A=-1 unchanged -> (-4.16 + 7.4) / 8 = 0.405
    loss, _ = maths.policy_loss(logprobs, old, ADVANTAGES, mask, clip_high=0.28)
    assert loss.item() == pytest.approx(0.405)
    # dual clip 3: the A=-1, rho=4 token is capped at -3 A = 3 (A=+1, rho=4 keeps -1.2) -> 3.4 - 1 = 2.4 / 8
    loss, metrics = maths.policy_loss(logprobs, old, ADVANTAGES, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(0.3)
    assert metrics["dual_clip_fraction"].item() == pytest.approx(1 / 8)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad[1, 3].item() == 0 and grad[1, 2].item() == pytest.approx(1.5 / 8)
    with pytest.raises(ValueError, match="dual_clip"):
        maths.policy_loss(logprobs, old, ADVANTAGES, mask, dual_clip=1.0)


def test_policy_loss_importance_weights():
    logprobs, old, mask = clip_case()
    weights = torch.tensor([[1.0, 0.5, 1.0, 1.0], [1.0, 1.0, 1.0, 0.25]]).requires_grad_()
    # [-0.5, -0.55, -1.2, -1.2] and [0.8, 1.1, 1.5, 1.0]: (-3.45 + 4.4) / 8 = 0.11875
    loss, _ = maths.policy_loss(logprobs, old, ADVANTAGES, mask, is_weights=weights)
    assert loss.item() == pytest.approx(0.11875)
    assert torch.autograd.grad(loss, weights, allow_unused=True) == (None,)  # no grad to the weights


def test_policy_loss_sequence_level_ratio():
    # row 0: log-ratios [log 2, log 0.5, log 4] -> mean (2/3) log 2, rho = 2^(2/3) = 1.587 > 1.2, A = +1:
    #   clipped, -1.2 on each token, no gradient. Row 1: [0.1, -0.1] (the 10 is masked) -> rho = 1,
    #   A = -1: loss rho = 1 per token. seq_mean_token_mean: (-1.2 + 1) / 2 = -0.1.
    # Gradient on row 1: d/d logp_t of (1/2 sequences) exp(mean of 2 log-ratios) = 1/2 * 1/2 = 0.25.
    logprobs = torch.tensor([[math.log(2), math.log(0.5), math.log(4)], [0.1, -0.1, 10.0]]).requires_grad_()
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    loss, metrics = maths.policy_loss(logprobs, torch.zeros(2, 3), ADVANTAGES, mask, aggregation="seq_mean_token_mean",
                                  ratio_level="sequence")
    assert loss.item() == pytest.approx(-0.1, abs=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad.tolist() == [pytest.approx([0, 0, 0]), pytest.approx([0.25, 0.25, 0])]
    assert metrics["clip_fraction"].item() == pytest.approx(3 / 5)
    assert metrics["ratio/mean"].item() == pytest.approx((3 * 2 ** (2 / 3) + 2) / 5)
    with pytest.raises(ValueError, match="token, sequence"):
        maths.policy_loss(logprobs, torch.zeros(2, 3), ADVANTAGES, mask, ratio_level="group")


# values [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]] with masks [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]:
# masked tokens {1, 2} and {5, 6, 7}: 5 tokens summing to 21, 2 sequences (the empty row does not count).
AGG_VALUES = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
AGG_MASK = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token_mean", {}, 21 / 5),
    ("token_mean", {"total_tokens": 10}, 21 / 10),
    ("seq_mean_token_mean", {}, (1.5 + 6) / 2),  # per-sequence means 1.5 and 6
    ("seq_mean_token_mean", {"total_sequences": 5}, 7.5 / 5),
    ("seq_mean_token_sum", {}, (3 + 18) / 2),
    ("seq_mean_token_sum_norm", {}, 21 / (2 * 4)),  # norm_length = padded length 4
    ("seq_mean_token_sum_norm", {"norm_length": 10}, 21 / (2 * 10)),
    ("seq_mean_token_sum_norm", {"norm_length": 7, "total_sequences": 3}, 21 / 21),
])
def test_aggregate_loss_modes(mode, kwargs, expected):
    assert maths.aggregate_loss(AGG_VALUES, AGG_MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_aggregate_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean"):
        maths.aggregate_loss(AGG_VALUES, AGG_MASK, "sum")


@pytest.mark.parametrize("mode", maths.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("pieces", [[2, 4], [1, 3, 2]], ids=["2 pieces", "3 pieces"])
def test_policy_loss_split_with_global_denominators_equals_unsplit(mode, pieces):
    """Micro-batches / data-parallel ranks: the pieces' losses with the whole batch's token and
    sequence counts sum to the unsplit loss, gradients included."""
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(6, 5, generator=g) * 2).requires_grad_()
    old = logprobs.detach() + torch.randn(6, 5, generator=g)  # ratios far enough from 1 to clip
    advantages = torch.randn(6, generator=g)
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1], [0, 0, 1, 0, 0], [1, 0, 1, 1, 0]])
    options = dict(aggregation=mode, clip_high=0.28, dual_clip=3.0, norm_length=8)
    whole, _ = maths.policy_loss(logprobs, old, advantages, mask, **options)
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    totals = dict(total_tokens=mask.sum(), total_sequences=(mask.sum(-1) > 0).sum())
    split = sum(maths.policy_loss(lp, o, a, m, **options, **totals)[0]
                for lp, o, a, m in zip(*(t.split(pieces) for t in (logprobs, old, advantages, mask))))
    (split_grad,) = torch.autograd.grad(split, logprobs)
    assert split.item() == pytest.approx(whole.item(), abs=1e-6)
    assert torch.allclose(split_grad, whole_grad, atol=1e-7)
    assert whole_grad.abs().sum() > 0


def test_explained_variance():
    # masked returns {1, 3, 5}: population variance 8/3; residuals returns - values = [-1, 0, 1]: 2/3
    returns, values = torch.tensor([[1.0, 3, 5, 100]]), torch.tensor([[2.0, 3, 4, NAN]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    assert maths.explained_variance(values, returns, mask).item() == pytest.approx(1 - (2 / 3) / (8 / 3))  # 0.75
    assert maths.explained_variance(returns, returns, mask).item() == 1.0
    assert maths.explained_variance(values, torch.full((1, 4), 2.0), mask).item() == 0.0  # nothing to explain


def test_vocab_parallel_entropy_excludes_padding():
    # columns 0-2 have probabilities [1/4, 1/4, 1/2]; column 3 is padding (beyond vocab_size 3)
    # H = 2 * (1/4) log 4 + (1/2) log 2 = 1.5 log 2 = 1.0397208
    logits = torch.tensor([[[0.0, 0.0, math.log(2), 50.0]]], requires_grad=True)
    entropy = vocab_parallel_entropy(logits, vocab_size=3)
    assert entropy.item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    logp = torch.log_softmax(logits[..., :3], -1)
    (grad,) = torch.autograd.grad(entropy.sum(), logits)
    (grad_ref,) = torch.autograd.grad(-(logp.exp() * logp).sum(), logits)
    assert torch.allclose(grad, grad_ref, atol=1e-6) and grad[..., 3].item() == 0
    assert grad.abs().sum() > 0


def test_masked_global_mean_var_single_process_gloo():
    distributed.init_process_group()  # this process as a world of one (idempotent), like the other tests
    group = dist.new_group(ranks=[0], backend="gloo")
    # masked {1, 2, 3, 6}: mean 3; deviations [-2, -1, 0, 3] -> population variance 14 / 4 = 3.5
    values = torch.tensor([[1.0, 2, NAN], [3, 6, -50]], requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])
    mean, var = distributed.masked_global_mean_var(values, mask, group)
    assert (mean.item(), var.item()) == (3.0, 3.5)
    assert not mean.requires_grad and not var.requires_grad
    assert [t.item() for t in distributed.masked_global_mean_var(values, torch.zeros(2, 3))] == [0.0, 0.0]


def test_group_advantages_baseline_from_ended_samples_only():
    # one group of 4: rewards 1, 0, 1, 0.5; sample 3 was cut at max_new_tokens (not in the baseline)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5])
    ended = torch.tensor([True, True, True, False])
    rloo = maths.group_advantages(rewards, 4, "rloo", baseline_mask=ended)
    # in the baseline: r - mean of the other ended ones; outside: r - mean of the ended ones (2/3)
    assert torch.allclose(rloo, torch.tensor([1 - 0.5, 0 - 1.0, 1 - 0.5, 0.5 - 2 / 3]))
    dr = maths.group_advantages(rewards, 4, "dr_grpo", baseline_mask=ended)
    assert torch.allclose(dr, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.5 - 2 / 3]))
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased, over the ended samples
    grpo = maths.group_advantages(rewards, 4, "grpo", baseline_mask=ended, eps=0.0)
    assert torch.allclose(grpo, dr / std)
    # all ended rewards equal: those get 0, the cut one still gets r - their mean
    same = maths.group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), 4, "rloo", baseline_mask=ended)
    assert same.tolist() == [0.0, 0.0, 0.0, -1.0]
    with pytest.raises(ValueError, match="baseline_mask"):
        maths.group_advantages(rewards, 4, "reinforce_pp", baseline_mask=ended)


def test_overlong_penalty_dapo():
    lengths = torch.tensor([4, 12, 13, 14, 16])
    penalty = maths.overlong_penalty(lengths, max_new_tokens=16, buffer=4, factor=0.5)
    # free up to 16 - 4 = 12 tokens, then linear to -0.5 at 16
    assert torch.allclose(penalty, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert maths.overlong_penalty(lengths, 16, 0).abs().sum() == 0


def test_adaptive_kl_coef_by_hand():
    from aligner.algorithms.online.maths import adaptive_kl_coef

    # kl 0.15 against a target of 0.1: error clip(0.5) = 0.2 -> x (1 + 0.2 * 64 / 1000) = x 1.0128
    assert adaptive_kl_coef(0.05, 0.15, 0.1, 1000, 64) == pytest.approx(0.05 * 1.0128)
    # kl 0.09: error -0.1 -> x (1 - 0.1 * 64 / 1000) = x 0.9936
    assert adaptive_kl_coef(0.05, 0.09, 0.1, 1000, 64) == pytest.approx(0.05 * 0.9936)
    assert adaptive_kl_coef(0.05, 0.1, 0.1, 1000, 64) == pytest.approx(0.05)  # on target: unchanged
