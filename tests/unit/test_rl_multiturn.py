"""Multi-turn samples in the RL loss (no model): observation tokens are left out of the response mask, receive
no gradient, and are not in the mismatch metrics; the values at the engine's tokens land where single-turn
ones do, however the sequences are packed."""
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from aligner.algorithms.online.loss import PolicyLoss, response_values, rl_micro_batches
from aligner.algorithms.online.samples import Sample
from aligner.config.rl_schema import RLAlgorithmConfig

PACKINGS = [{"packed": False, "capacity": None, "flat": False}, {"packed": True, "capacity": None, "flat": True},
            {"packed": True, "capacity": 12, "flat": False}]


def samples():
    """Two episodes (turn, observation, turn) and a single-turn sample; token ids = 10 + response index."""
    prompts = [SimpleNamespace(ids=[5, 6, 7]), SimpleNamespace(ids=[8, 9]), SimpleNamespace(ids=[1, 2, 3, 4])]
    masks = [[1, 1, 0, 0, 0, 1], [1, 0, 1, 1], None]
    lengths = [6, 4, 3]
    out = []
    for prompt, mask, n, advantage in zip(prompts, masks, lengths, [1.0, -0.5, 2.0]):
        logprobs = [-0.1 * (j + 1) if mask is None or mask[j] else 0.0 for j in range(n)]
        out.append(Sample(prompt, [10 + j for j in range(n)], logprobs, True, advantage=advantage, token_mask=mask))
    return out


@pytest.mark.parametrize("packing", PACKINGS)
def test_observation_tokens_are_out_of_the_mask_and_the_values(packing):
    (batch,), _ = rl_micro_batches([samples()], pad_id=0, packing=packing, multiple=1)
    got = response_values(batch["labels"].float(), batch, batch)  # the value at a position = the label it predicts
    expected = torch.tensor([[10, 11, 0, 0, 0, 15], [10, 0, 12, 13, 0, 0], [10, 11, 12, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(batch["response_mask"], (expected > 0).float())
    invalid = samples()
    invalid[0].valid = False
    (batch,), _ = rl_micro_batches([invalid], pad_id=0, packing=packing, multiple=1)
    assert batch["response_mask"][0].sum() == 0 and batch["response_mask"][1].sum() == 3


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_observation_tokens_get_no_gradient_and_stay_out_of_the_mismatch(aggregation):
    """The loss (clipped surrogate, k3 KL, entropy bonus) differentiated by the per-position values: zero at the
    positions that predict observation tokens, nonzero at those predicting the engine's tokens; the mismatch
    metrics equal hand computations over the engine's tokens only."""
    (batch,), _ = rl_micro_batches([samples()], pad_id=0, packing=PACKINGS[0], multiple=1)
    a = OmegaConf.structured(RLAlgorithmConfig)
    a.kl.coef, a.entropy_coef, a.aggregation = 0.1, 0.01, aggregation
    torch.manual_seed(0)
    width = batch["response_mask"].shape[1]
    batch["old_logprobs"] = -torch.rand(3, width)
    batch["ref_logprobs"] = -torch.rand(3, width)
    per_position = torch.stack([-torch.rand(batch["tokens"].shape), torch.rand(batch["tokens"].shape)], -1)
    per_position.requires_grad_(True)
    loss, count, report = PolicyLoss(a, max_new_tokens=6)(per_position, batch, batch)
    loss.backward()
    grad = per_position.grad.abs().sum(-1)  # [rows, length]; row r is sample r (padded layout)
    for row, sample in enumerate(samples()):
        start = len(sample.prompt.ids) - 1  # the position predicting response token 0
        for j, m in enumerate(sample.response_token_mask()):
            assert (grad[row, start + j] > 0) == bool(m), (row, j)
    mask = batch["response_mask"] > 0
    trainer = batch["old_logprobs"][mask]
    engine = batch["engine_logprobs"][mask]
    assert report["tokens"] == 9
    assert torch.allclose(report["token_prob_error"] / 9, (trainer - engine).abs().exp().mean())
    k3 = torch.expm1(trainer - engine) - (trainer - engine)
    assert torch.allclose(report["mismatch_kl"] / 9, k3.mean())
