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


def test_dynamic_sampling_episode_metrics_cover_the_steps_batch():
    """With DAPO's refills, a multi-turn step's episode/* and fraction/* metrics are over the episodes its batch
    trains (the informative groups, whichever generate made them; not only the last refill's), and timing/env_s
    adds up every generate's environment time. The trainer is a stub around RLTrainer's own rollouts and
    finish_step; generation returns hand-made episodes."""
    import time

    from aligner.algorithms.online.rl import RLTrainer
    from aligner.algorithms.online.rollouts import Timings
    from aligner.envs.episodes import Summary
    from aligner.generation.types import SamplingParams
    from tests.conftest import init_single_process

    init_single_process()  # scores are shared with a broadcast, as on every rank of a run

    def episode(score, turns, end="env"):
        summary = Summary(turns, turns - 1, end, "", [{"role": "assistant", "text": "x", "reward": score}] * turns)
        return Sample(SimpleNamespace(ids=[1], text="?", fields={}), [5] * turns, [-0.1] * turns, True, score=score,
                      token_mask=[1] * turns, episode=summary)

    first = [episode(1.0, 1), episode(1.0, 1), episode(0.0, 2), episode(2.0, 3)]  # group 1 equal: dropped
    refill = [episode(0.0, 3, "env_error"), episode(1.0, 3), episode(1.0, 4), episode(1.0, 4)]  # group 4 equal
    trainer = object.__new__(RLTrainer)
    a = trainer.a = OmegaConf.structured(RLAlgorithmConfig)
    a.prompts_per_step, a.num_generations = 2, 2
    a.dynamic_sampling.enabled, a.dynamic_sampling.max_refills = True, 1
    trainer.multiturn, trainer.scorer, trainer.separate, trainer.step = True, object(), None, 0
    trainer.params = SamplingParams(max_new_tokens=8)
    generates = iter([first, refill])

    def generate(prompts):
        trainer.env_s += 1.5
        return next(generates)

    trainer.generate, trainer.next_prompts, trainer.write_rollouts = generate, lambda: [], lambda samples: None
    trainer.sampler = SimpleNamespace(state_dict=lambda: {"consumed_samples": 8})
    samples, _, dropped, seen = trainer.rollouts(Timings())
    assert samples == first[2:] + refill[:2] and (dropped, seen) == (2, 4)
    metrics = trainer.finish_step({}, Timings(), time.perf_counter(), samples)
    assert metrics["episode/turns_mean"] == (2 + 3 + 3 + 3) / 4 and metrics["episode/tool_calls_mean"] == 7 / 4
    assert metrics["fraction/env_errors"] == 0.25 and metrics["timing/env_s"] == 3.0
