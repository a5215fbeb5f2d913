"""The RL loss's layout and terms against direct per-sample computations (no model)."""
import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from aligner.algorithms.online import maths
from aligner.algorithms.online.loss import (PolicyLoss, response_values, rl_micro_batches,
                                           set_advantages_and_validity, token_logprob_values, token_values)
from aligner.generation.types import SamplingParams
from aligner.algorithms.online.samples import Sample
from aligner.config.rl_schema import RLAlgorithmConfig


def samples():
    prompts = [SimpleNamespace(ids=[5, 6, 7]), SimpleNamespace(ids=[8, 9]), SimpleNamespace(ids=[1, 2, 3, 4])]
    responses = [[10, 11], [12, 13, 14, 15], [16]]
    return [Sample(p, r, [-0.1 * (j + 1) for j in range(len(r))], True, advantage=a)
            for p, r, a in zip(prompts, responses, [1.0, -0.5, 2.0])]


@pytest.mark.parametrize("packing", [{"packed": False, "capacity": None, "flat": False},
                                     {"packed": True, "capacity": None, "flat": True},
                                     {"packed": True, "capacity": 8, "flat": False}])
def test_response_values_put_each_token_in_its_sample_row(packing):
    group = samples()
    (batch,), _ = rl_micro_batches([group], pad_id=0, packing=packing, multiple=1)
    # a model output whose value at a position is the label it predicts
    values = batch["labels"].float()
    got = response_values(values, batch, batch)  # no context parallelism: this rank holds every position
    expected = torch.tensor([[10, 11, 0, 0], [12, 13, 14, 15], [16, 0, 0, 0]], dtype=torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(batch["response_mask"], (expected > 0).float())
    assert torch.allclose(batch["engine_logprobs"][1], torch.tensor([-0.1, -0.2, -0.3, -0.4]))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_advantages_and_validity_land_on_the_batch_device(device):
    """After the log-prob passes a batch's tensors are on the trainer's device (a GPU's; `meta` stands in for it
    here, as it too refuses a CPU operand); a sample whose score failed since has its mask row zeroed."""
    group = samples()
    (batch,), _ = rl_micro_batches([group], pad_id=0, packing={"packed": False, "capacity": None, "flat": False},
                                   multiple=1)
    batch["response_mask"] = batch["response_mask"].to(device)
    group[1].valid = False
    set_advantages_and_validity(batch, group)
    assert batch["advantages"].device.type == batch["response_mask"].device.type == device
    if device == "cpu":
        assert batch["advantages"].tolist() == [1.0, -0.5, 2.0]
        assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_policy_loss_term_sums_match_direct_maths():
    group = samples()
    (batch,), _ = rl_micro_batches([group], pad_id=0, packing={"packed": False, "capacity": None, "flat": False},
                                   multiple=1)
    torch.manual_seed(0)
    logprobs = -torch.rand(3, 4)
    batch["old_logprobs"] = logprobs - 0.05 * torch.randn(3, 4)
    batch["ref_logprobs"] = logprobs + 0.1 * torch.randn(3, 4)
    a = OmegaConf.structured(RLAlgorithmConfig)
    a.kl.coef, a.entropy_coef, a.aggregation = 0.1, 0.01, "seq_mean_token_mean"
    # per-position values: (log-prob, entropy) placed where each response token is predicted
    mask = batch["loss_mask"] > 0
    per_position = torch.zeros(*batch["tokens"].shape, 2)
    per_position[mask] = torch.stack([logprobs[batch["response_mask"] > 0], torch.full((7,), 2.0)], -1)
    loss, count, report = PolicyLoss(a, max_new_tokens=4)(per_position, batch, batch)
    m = batch["response_mask"]
    surrogate, _ = maths.policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], m,
                                 aggregation="seq_mean_token_mean")
    kl = maths.aggregate_loss(maths.kl_penalty(logprobs, batch["ref_logprobs"], "k3"), m, "seq_mean_token_mean")
    expected = surrogate + 0.1 * kl - 0.01 * 2.0  # the entropy's sequence means are all 2
    assert count == 3  # sequences: the loss is a sum over them, megatron divides by the global count
    assert torch.allclose(loss / count, expected)
    assert torch.isclose(report["tokens"], torch.tensor(7.0))
    assert torch.isclose(report["entropy"], torch.tensor(14.0))


def test_the_forward_only_values_are_the_log_probs_of_the_update_values():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 9, (2, 5))
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, max_new_tokens=4)
    update = token_values(9, params, entropy_grad=False)(logits, {"labels": labels})
    forward_only = token_logprob_values(9, params)(logits, {"labels": labels})
    assert forward_only.shape == (2, 5, 1) and torch.equal(forward_only[..., 0], update[..., 0])


@pytest.mark.parametrize("source", ["trainer", "engine"])
def test_the_mismatch_metrics_compare_the_trainers_rollout_log_probs_with_the_engines(source):
    """old_logprobs=trainer: the old log-probs are the trainer's forward before the update; engine: they are
    the engine's, and the update's own forward (the rollout policy on the first pass) is compared instead."""
    group = samples()
    (batch,), _ = rl_micro_batches([group], pad_id=0, packing={"packed": False, "capacity": None, "flat": False},
                                   multiple=1)
    m = batch["response_mask"]
    logprobs = batch["engine_logprobs"] - 0.2 * m  # the trainer's, each 0.2 below the engine's
    batch["old_logprobs"] = logprobs - 0.1 * m if source == "trainer" else batch["engine_logprobs"]
    a = OmegaConf.structured(RLAlgorithmConfig)
    a.old_logprobs = source
    per_position = torch.zeros(*batch["tokens"].shape, 2)
    per_position[batch["loss_mask"] > 0, 0] = logprobs[m > 0]
    _, _, report = PolicyLoss(a, max_new_tokens=4)(per_position, batch, batch)
    gap = 0.3 if source == "trainer" else 0.2  # mean exp|log p - log q| over the 7 response tokens, summed
    assert torch.isclose(report["token_prob_error"], torch.tensor(7 * math.exp(gap)))
