"""Train/inference mismatch metrics on hand-computed cases, and `aligner generate` argument handling."""
import math

import pytest
import torch

from aligner.generation.cli import UsageError, generate_main, parse_overrides
from aligner.generation.mismatch import kl, token_prob_error, truncated_is_weights

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


def test_overrides_parse_and_reject_unknown_keys():
    values = parse_overrides(["sampling.greedy=true", "sampling.top_k=5", "batch_size=4",
                              "model.tensor_model_parallel_size=2", "launcher.nproc_per_node=2"])
    assert values["sampling.greedy"] is True and values["sampling.top_k"] == 5 and values["batch_size"] == 4
    assert values["sampling.temperature"] == 1.0  # default
    with pytest.raises(UsageError, match="sampling.tempreature"):
        parse_overrides(["sampling.tempreature=0.5"])
    with pytest.raises(UsageError, match="not a multiple"):
        parse_overrides(["model.tensor_model_parallel_size=2"])
    with pytest.raises(UsageError, match="expected int"):
        parse_overrides(["sampling.top_k=many"])


def test_generate_main_reports_usage_errors(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    assert generate_main(["--model", str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                          "sampling.bogus=1"]) == 2
    assert "unknown override 'sampling.bogus'" in capsys.readouterr().err
    assert generate_main(["--model", str(tmp_path / "missing"), "--prompts", str(prompts), "--out", "o"]) == 2
    assert "does not exist" in capsys.readouterr().err
