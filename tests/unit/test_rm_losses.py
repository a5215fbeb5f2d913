"""Reward-model and critic losses by hand: Bradley-Terry with margins, the centering term and its gradient,
the regression loss's mask, the clipped value loss, a sequence's score read at its last token; the synthetic
preference pairs are swapped twins of near misses."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import init_single_process


def test_bradley_terry_hand_computed():
    from aligner.algorithms.preference.reward_model import pair_loss

    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.5, 1.0])
    loss, report = pair_loss(chosen, rejected)
    expected = -(math.log(1 / (1 + math.exp(-1.0))) + math.log(1 / (1 + math.exp(0.5))) + math.log(0.5))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert report["accuracy"].item() == 1.5  # one win, one loss, one tie (1/2)
    assert report["reward/margin"].item() == pytest.approx(0.5)
    assert report["reward/chosen"].item() == 3.0 and report["reward/rejected"].item() == 2.5
    margin_loss, _ = pair_loss(chosen, rejected, torch.tensor([1.0, 0.0, 0.0]))
    assert margin_loss.item() == pytest.approx(expected + math.log(1 / (1 + math.exp(-1.0))) - math.log(0.5))


def test_centering_term_hand_computed():
    from aligner.algorithms.preference.reward_model import pair_loss

    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, -0.5])
    plain, _ = pair_loss(chosen, rejected)
    centred, report = pair_loss(chosen, rejected, center_coef=0.1)
    assert centred.item() == pytest.approx(plain.item() + 0.1 * (3.0 ** 2 + 0.5 ** 2), rel=1e-6)
    assert report["loss"].item() == pytest.approx(centred.item())
    # its gradient pulls both rewards of a pair down by 2c(r_c + r_r), the BT term's not at all
    chosen.requires_grad_(True)
    pair_loss(chosen, torch.tensor([-2.0, 0.0]), center_coef=0.5)[0].backward()
    bt_grad = -torch.sigmoid(-(chosen.detach() - torch.tensor([-2.0, 0.0])))
    assert torch.allclose(chosen.grad, bt_grad + 2 * 0.5 * (chosen.detach() + torch.tensor([-2.0, 0.0])))


def test_synthetic_pairs_are_swapped_twins_of_near_misses():
    from collections import Counter

    from aligner.data.preference_rm import arithmetic_preferences

    records = arithmetic_preferences(4000, seed=3, max_operand=9, ops="+-*", max_miss=3)
    assert len(records) == 4000 and records == arithmetic_preferences(4000, seed=3, max_operand=9, ops="+-*",
                                                                     max_miss=3)
    chosen, rejected = Counter(r["chosen"] for r in records), Counter(r["rejected"] for r in records)
    assert chosen == rejected  # no answer is preferred whatever the question
    for twin_a, twin_b in zip(records[::2], records[1::2]):
        assert (twin_a["chosen"], twin_a["rejected"]) == (twin_b["rejected"], twin_b["chosen"])
        assert twin_a["prompt"][0]["content"] != twin_b["prompt"][0]["content"]
    gaps = Counter(abs(int(r["chosen"]) - int(r["rejected"])) for r in records)
    assert set(gaps) - {1, 2, 3} and sum(gaps[g] for g in (1, 2, 3)) > 0.98 * len(records)  # 81 = 9*9 has none
    assert all(int(r["chosen"]) == eval(r["prompt"][0]["content"][8:-1]) for r in records)


def test_regression_loss_masks_missing_labels():
    from aligner.algorithms.preference.reward_model import regression_loss

    predicted = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    labels = torch.tensor([[0.0, 2.0], [5.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, count, report = regression_loss(predicted, labels, mask)
    assert loss.item() == 1.0 + 0.0 + 4.0 and count.item() == 3 and report["abs_error"].item() == 3.0
    labels[1, 1] = float("nan")  # an unlabelled attribute's placeholder never reaches the loss
    assert regression_loss(predicted, labels, mask)[0].item() == 5.0


def test_clipped_value_loss_hand_computed():
    from aligner.algorithms.online.maths import clipped_value_loss

    values, old, returns = torch.tensor([[1.0, 0.0, 0.5]]), torch.tensor([[0.0, 0.0, 0.4]]), torch.tensor([[1.0, 2.0, 0.0]])
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    # token 0: V=1 -> V_clip=0.2, max((0)^2, (0.8)^2)/2 = 0.32, clipped term larger
    # token 1: V=V_old=0 -> both (2)^2, 2.0, not clipped; token 2: V_clip=0.5 (within 0.4+-0.2) -> 0.125
    assert torch.allclose(loss, torch.tensor([[0.32, 2.0, 0.125]])) and clipped.tolist() == [[1.0, 0.0, 0.0]]


def test_sequence_scores_read_the_last_token():
    from aligner.models.forward_step import scores_at_row_ends

    init_single_process()
    values = torch.arange(12.0).view(2, 6, 1)
    assert scores_at_row_ends(values, torch.tensor([3, 6]), torch.arange(6)).flatten().tolist() == [2.0, 11.0]
