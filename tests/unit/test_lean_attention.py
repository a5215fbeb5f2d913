"""The lean decoder's one-position attention (`attend_step`) against attention computed in fp64 from the same
inputs: in fp32, and in bf16, where its scores must stay in fp32 as the trainer's attention keeps them (a bf16
product rounds scores of ~70 by ~0.25, which moves the output ~10x more than rounding the output itself)."""
import pytest
import torch

from aligner.generation.lean_decode import attend_step

B, G, R, D, C, WRITTEN = 3, 2, 4, 64, 64, 40  # batch, query groups, heads per group, head dim, capacity, slots in use


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, G, R, D, generator=g) * 1.5  # scaled queries: scores up to ~70
    keys, values = torch.randn(B, G, C, D, generator=g) * 1.5, torch.randn(B, G, C, D, generator=g)
    bias = torch.zeros(C)
    bias[WRITTEN:] = float("-inf")  # the cache's unwritten slots
    return [t.to(dtype) for t in (q, keys, values, bias)]


def reference(q, keys, values, bias):
    q, keys, values, bias = (t.double() for t in (q, keys, values, bias))
    scores = torch.einsum("bgrd,bgcd->bgrc", q[:, 0], keys) + bias
    return torch.einsum("bgrc,bgcd->bgrd", scores.softmax(-1), values).reshape(B, G * R * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_step_keeps_the_scores_exact_enough(dtype):
    q, keys, values, bias = inputs(dtype)
    expected = reference(q, keys, values, bias)
    assert expected.abs().max() > 1  # outputs of order 1: the bounds below are relative to them
    got = attend_step(q, keys, values, bias)
    assert got.dtype == dtype and got.shape == (B, G * R * D)
    own_rounding = (expected.to(dtype).double() - expected).abs().max()  # the output's rounding alone
    error = (got.double() - expected).abs().max()
    assert error <= (1e-5 if dtype == torch.float32 else 2 * own_rounding), (error, own_rounding)


def test_unwritten_slots_are_not_attended():
    q, keys, values, bias = inputs(torch.bfloat16)
    garbage = values.clone()
    garbage[:, :, WRITTEN:] = 1e4
    assert torch.equal(attend_step(q, keys, garbage, bias), attend_step(q, keys, values, bias))
