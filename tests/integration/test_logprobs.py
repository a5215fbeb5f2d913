"""Vocab-parallel log-probs and entropy against torch's log_softmax, forward and backward,
with megatron's padded vocabulary rows excluded: both the split-vocabulary function (here on one
rank; TP=2 is covered by the parity tests, whose loss and gradients go through it) and the
one-rank path that `vocab_parallel_logprobs` takes without TP."""
import pytest
import torch

from aligner.models.logprobs import (_VocabParallelLogProbs, vocab_parallel_entropy, vocab_parallel_logprobs,
                                    vocab_parallel_logprobs_and_entropy)


def _case(vocab=37, padded=40, shape=(3, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, padded, generator=g) * 3).requires_grad_()
    target = torch.randint(0, vocab, shape, generator=g)
    return logits, target


@pytest.mark.parametrize("logprobs", [vocab_parallel_logprobs, _VocabParallelLogProbs.apply], ids=["entry", "split"])
def test_logprobs_match_log_softmax_and_ignore_padding(logprobs):
    logits, target = _case()
    ours = logprobs(logits, target, 37)
    reference = torch.log_softmax(logits[..., :37], -1).gather(-1, target[..., None]).squeeze(-1)
    assert torch.allclose(ours, reference, atol=1e-6)
    weights = torch.randn(ours.shape)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (g_ref,) = torch.autograd.grad((reference * weights).sum(), logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-6)
    assert g_ours[..., 37:].abs().max() == 0  # padding rows get no gradient


def test_entropy_matches_definition_and_gradient():
    logits, _ = _case(seed=1)
    ours = vocab_parallel_entropy(logits, vocab_size=37)
    logp = torch.log_softmax(logits[..., :37], -1)
    reference = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(ours, reference, atol=1e-5)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_ref,) = torch.autograd.grad(reference.sum(), logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-5)


def test_uniform_logits_hand_computed():
    logits = torch.zeros(1, 1, 8)
    assert torch.allclose(vocab_parallel_logprobs(logits, torch.tensor([[3]]), 4), torch.tensor([[-torch.log(torch.tensor(4.0))]]))
    assert torch.allclose(vocab_parallel_entropy(logits, 4), torch.log(torch.tensor([[4.0]])))


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logprobs_and_entropy_together_equal_each_alone(entropy_grad):
    """One log-softmax for both (no entropy gradient), or the two functions: the same numbers, with
    filtered (-inf) columns, which have no entropy, and padding columns."""
    logits, target = _case(seed=2)
    filtered = logits.detach().clone()
    filtered[..., 30:37] = float("-inf")  # top-k filtered columns
    filtered.requires_grad_()
    target = target.clamp(max=29)
    logprobs, entropy = vocab_parallel_logprobs_and_entropy(filtered, target, 37, entropy_grad)
    assert torch.allclose(logprobs, vocab_parallel_logprobs(filtered, target, 37), atol=1e-6)
    assert torch.allclose(entropy, vocab_parallel_entropy(filtered, 37), atol=1e-5)
    assert torch.isfinite(entropy).all() and entropy.requires_grad == entropy_grad
    (grad,) = torch.autograd.grad(logprobs.sum(), filtered)
    (expected,) = torch.autograd.grad(vocab_parallel_logprobs(filtered, target, 37).sum(), filtered)
    assert torch.allclose(grad, expected, atol=1e-6)


def test_split_gradient_where_some_targets_are_another_ranks(monkeypatch):
    """As TP rank 1 of 2 (columns 40-79 here; no other rank, so its softmax is over these): d logp / d z_j is
    1[j is the target] - p_j where the target is this rank's, -p_j where it is the other rank's."""
    import aligner.models.logprobs as lp

    monkeypatch.setattr(lp, "_tp_group", lambda: (None, 1))
    logits, _ = _case(padded=40)
    target = torch.randint(0, 80, (3, 5), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 5)
    (grad,) = torch.autograd.grad((_VocabParallelLogProbs.apply(logits, target, 80) * weights).sum(), logits)
    mine = target >= 40
    assert 0 < int(mine.sum()) < mine.numel()
    onehot = torch.nn.functional.one_hot((target - 40).clamp(min=0), 40) * mine.unsqueeze(-1)
    expected = (onehot - torch.softmax(logits.detach(), -1)) * weights.unsqueeze(-1)
    assert torch.allclose(grad, expected, atol=1e-6)
    # and no shape that depends on which targets are this rank's (a host sync on a GPU): the meta device runs it
    meta = logits.detach().to("meta").requires_grad_()
    (grad,) = torch.autograd.grad(_VocabParallelLogProbs.apply(meta, target.to("meta"), 80).sum(), meta)
    assert grad.shape == logits.shape
