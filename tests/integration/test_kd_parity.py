"""The vocab-parallel top-k KD loss: its value and gradient at TP=2 equal TP=1's (tests/kd_workers.py)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.dist
def test_vocab_parallel_loss_and_gradient_at_tp2_equal_tp1(tmp_path):
    from aligner.launch.local import launch

    launch("tests.kd_workers:loss_parity", [str(tmp_path)], 2, log_dir=tmp_path / "logs")
    diffs = json.loads((tmp_path / "parity.json").read_text())
    print(diffs)
    for name, d in diffs.items():
        assert d["ids_equal"] and d["ids_below_vocab"] and d["values"] == 0.0, name  # the same top-k
        assert d["kd_value"] > 0.1, name  # a loss worth comparing
        assert d["loss"] < 1e-5 and d["kd"] < 1e-5 and d["sft"] < 1e-5, (name, d)
        assert d["grad"] < 1e-6 * max(1.0, d["grad_norm"]), (name, d)
        assert d["padding_grad"] == 0.0, name
