"""Train/inference mismatch metrics on hand-computed cases."""
import math

import pytest
import torch

from aligner.algorithms.online.mismatch import kl, token_prob_error, truncated_is_weights

LN2 = math.log(2.0)


def _case():
    # two sequences; the second has one padding position
    trainer = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.4), 0.0]])
    engine = torch.tensor([[math.log(0.25), math.log(0.2)], [math.log(0.8), -9.0]])
    mask = torch.tensor([[True, True], [True, False]])
    return trainer, engine, mask


def test_token_prob_error():
    trainer, engine, mask = _case()
    # |delta| = ln2, 0, ln2 -> exp: 2, 1, 2 -> mean 5/3
    assert math.isclose(token_prob_error(trainer, engine, mask).item(), 5 / 3, rel_tol=1e-6)
    assert token_prob_error(engine, engine).item() == 1.0


def test_kl_estimators():
    trainer, engine, mask = _case()
    # log r = log p - log q = ln2, 0, -ln2
    k1 = (-LN2 + 0 + LN2) / 3
    k3 = ((2 - 1 - LN2) + 0 + (0.5 - 1 + LN2)) / 3
    assert math.isclose(kl(trainer, engine, mask, "k1").item(), k1, abs_tol=1e-7)
    assert math.isclose(kl(trainer, engine, mask).item(), k3, rel_tol=1e-6)
    assert kl(engine, engine).item() == 0.0
    with pytest.raises(ValueError, match="estimator"):
        kl(trainer, engine, mask, "k2")


def test_truncated_importance_weights():
    trainer, engine, mask = _case()
    token = truncated_is_weights(trainer, engine, mask, "token", cap=1.5)
    assert torch.allclose(token, torch.tensor([[1.5, 1.0], [0.5, 0.0]]))
    seq = truncated_is_weights(trainer, engine, mask, "sequence", cap=10.0)
    # sequence 0: exp(ln2 + 0) = 2; sequence 1: exp(-ln2) = 0.5 (padding excluded)
    assert torch.allclose(seq, torch.tensor([[2.0, 2.0], [0.5, 0.0]]))
    capped = truncated_is_weights(trainer, engine, mask, "sequence", cap=1.5)
    assert torch.allclose(capped, torch.tensor([[1.5, 1.5], [0.5, 0.0]]))
    assert not truncated_is_weights(trainer.requires_grad_(), engine, mask).requires_grad
    with pytest.raises(ValueError, match="level"):
        truncated_is_weights(trainer, engine, mask, "batch")
