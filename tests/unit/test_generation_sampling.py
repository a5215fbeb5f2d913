"""Sampling maths, counter-based RNG, stop helpers and Rollout plumbing (pure functions, one process)."""
import math

import pytest
import torch

from aligner.generation import rng, sampling
from aligner.generation.stopping import StopStrings, extract_responses, stop_reasons
from aligner.generation.types import Rollout, SamplingParams

NEG_INF = float("-inf")


def test_temperature_and_top_k_hand_computed():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    assert torch.equal(sampling.apply_temperature(logits, 2.0), logits / 2)
    kept = sampling.top_k_filter(logits, 2)
    assert torch.equal(kept, torch.tensor([[NEG_INF, 3.0, NEG_INF, 3.0, NEG_INF]]))
    kept = sampling.top_k_filter(logits, 3)  # ties with the k-th largest are kept: 3, 3, 2
    assert torch.equal(kept.isfinite(), torch.tensor([[False, True, True, True, False]]))
    assert torch.equal(sampling.top_k_filter(logits, 0), logits)


def test_top_p_hand_computed():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    # sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95
    assert sampling.top_p_filter(logits, 0.5).isfinite().tolist() == [[True, False, False, False]]
    assert sampling.top_p_filter(logits, 0.51).isfinite().tolist() == [[True, False, True, False]]
    assert sampling.top_p_filter(logits, 0.9).isfinite().tolist() == [[True, False, True, True]]
    assert sampling.top_p_filter(logits, 1.0).isfinite().all()
    assert sampling.top_p_filter(logits, 1e-6).isfinite().sum() == 1  # always at least one token


def test_filter_order_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
    scaled = logits / 0.5
    p = torch.softmax(scaled[:, :3], -1)  # after top-k: 3 tokens
    expected_keep = (p.sort(descending=True).values.cumsum(-1) - p.sort(descending=True).values) < 0.9
    out = sampling.filter_logits(logits, params)
    assert out.isfinite().sum().item() == expected_keep.sum().item()
    assert torch.equal(out[out.isfinite()], scaled[0, : expected_keep.sum().item()])
    assert torch.equal(sampling.filter_logits(logits, SamplingParams(greedy=True, top_k=1)), logits)


def test_logprob_is_under_the_sampled_distribution():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8)
    u = rng.uniform(rng.step_keys(range(6), 1))[:, 0]
    tokens, logprobs = sampling.sample(logits, params, u)
    q = torch.log_softmax(sampling.filter_logits(logits, params), -1)
    assert torch.allclose(logprobs, q.gather(-1, tokens[:, None]).squeeze(1), atol=1e-6)
    assert q.gather(-1, tokens[:, None]).isfinite().all()  # never a filtered-out token
    raw = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(1)
    assert (logprobs - raw).abs().max() > 0.1  # NeMo-Aligner #46: not the unfiltered model's log-prob
    greedy_tokens, greedy_logprobs = sampling.sample(logits, SamplingParams(greedy=True), None)
    assert torch.equal(greedy_tokens, logits.argmax(-1))
    assert torch.allclose(greedy_logprobs, torch.log_softmax(logits, -1).max(-1).values, atol=1e-6)


def test_sampler_frequencies_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, NEG_INF, 0.5]])
    n = 40000
    u = rng.uniform(rng.step_keys(range(n), 1))[:, 0]
    tokens, _ = sampling.sample(logits.expand(n, -1), SamplingParams(temperature=1.0), u)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(logits[0].double(), -1) * n
    assert counts[4] == 0
    chi2 = ((counts - expected)[expected > 0] ** 2 / expected[expected > 0]).sum().item()
    assert chi2 < 25, (counts, expected)  # 4 degrees of freedom: p ~ 5e-5


def test_rng_is_counter_based_and_uniform():
    keys = rng.step_keys([1, 2, 3], 5)
    assert torch.equal(keys[1], rng.step_keys([2], 5)[0])  # independent of the other samples
    assert torch.equal(keys[:, :3], rng.step_keys([1, 2, 3], 3))  # and of the number of steps
    assert keys.unique().numel() == 15 and int(keys.min()) >= 0 and int(keys.max()) < 2**32
    u = rng.uniform(rng.step_keys(range(20000), 1))
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert rng.sample_key(-1) == rng.sample_key(2**64 - 1)
    assert len({rng.derive_seed(0, i) for i in range(1000)}) == 1000
    assert rng.mix32(12345) == int(rng.mix32(torch.tensor([12345]))[0])


def test_ban_rows():
    logits = torch.zeros(3, 5)
    sampling.ban(logits, torch.tensor([1, 4]), torch.tensor([True, False, True]))
    assert logits.isinf().sum(-1).tolist() == [2, 0, 2]
    sampling.ban(logits, torch.tensor([0]))
    assert logits[:, 0].isinf().all()


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=5, max_new_tokens=4)
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_extract_responses_and_stop_reasons():
    buffer = torch.tensor([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]])
    slot_lp = torch.arange(12.0).view(2, 6)
    ids, lps = extract_responses(buffer, slot_lp, torch.tensor([2, 4]), torch.tensor([3, 1]), pad_id=-1)
    assert ids.tolist() == [[7, 8, 9], [5, -1, -1]] and lps.tolist() == [[2.0, 3.0, 4.0], [10.0, 0.0, 0.0]]
    reasons = stop_reasons([[1, 2], [3, 9], [4], [4, 5]], [False, False, True, False], eos_id=2, stop_token_ids=[9])
    assert reasons == ["eos", "stop_token", "stop_string", "length"]


def test_stop_strings_span_tokens():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    matcher = StopStrings(Chars(), ["cd"], batch=2)
    assert matcher.update([ord("a"), ord("c")], [True, True]) == []
    assert matcher.update([ord("b"), ord("d")], [True, True]) == [1]
    assert matcher.update([ord("c"), ord("x")], [True, False]) == []
    assert matcher.update([ord("d"), ord("x")], [True, False]) == [0]
    assert matcher.hit == [True, True] and matcher.responses[1] == [ord("c"), ord("d")]


def test_rollout_concat_and_views():
    a = Rollout([[1]], torch.tensor([[4, 5]]), torch.tensor([2]), torch.tensor([[-1.0, -2.0]]), torch.tensor([True]),
                ["eos"], info={"decode_steps": 2})
    b = Rollout([[2, 3]], torch.tensor([[6, 0, 0]]), torch.tensor([1]), torch.tensor([[-0.5, 0.0, 0.0]]),
                torch.tensor([False]), ["length"], info={"decode_steps": 3})
    both = Rollout.concat([a, b], pad_id=0)
    assert both.responses() == [[4, 5], [6]] and both.response_ids.shape == (2, 3)
    assert both.response_logprobs() == [[-1.0, -2.0], [-0.5]] and both.info["decode_steps"] == 5
    assert both.mask().tolist() == [[True, True, False], [True, False, False]]
    assert both.stop_reason == ["eos", "length"] and math.isclose(float(both.logprobs.sum()), -3.5)
