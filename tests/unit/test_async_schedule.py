"""Asynchronous RL's pure pieces: the lag schedule, the truncated-importance bookkeeping it relies on, and the
config refusals before launch (online/separate.py, online/mismatch.py, config/rl_schema.py)."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.algorithms.online.mismatch import truncated_fraction, truncated_is_weights
from aligner.algorithms.online.separate import SeparateRollouts, rollout_version
from aligner.config import load_config
from aligner.errors import ConfigError

GRPO = ["data.train_path=prompts.jsonl", "tokenizer.path=tok", "model.pretrained=null",
        "reward.functions=[arithmetic]"]


def test_step_t_trains_the_weights_after_step_t_minus_1_minus_k():
    table = {k: [rollout_version(t, k) for t in range(1, 8)] for k in (0, 1, 4)}
    assert table == {0: [0, 1, 2, 3, 4, 5, 6], 1: [0, 0, 1, 2, 3, 4, 5], 4: [0, 0, 0, 0, 0, 1, 2]}
    assert [t - 1 - rollout_version(t, 2) for t in range(1, 6)] == [0, 1, 2, 2, 2]  # async/lag = min(t-1, k)


def test_kept_weights_outlive_the_checkpoint_being_saved(tmp_path):
    """k=1, checkpoints every 2 steps: saving step 4 keeps version 1 on disk, which the step-2 checkpoint needs
    until step 4's is complete (a run killed during that save resumes from step 2); saving step 6 then
    deletes it. A run resumed from step 2 keeps it through its first save too."""
    def saves(steps, resumed_from=None):
        separate = SeparateRollouts(type("Trainer", (), {"run_dir": tmp_path})(), workers=object(), max_lag=1)
        if resumed_from:
            separate.after_resume(resumed_from)
        for step in steps:
            separate.kept[step - 1] = {"w": torch.full((2,), float(step - 1))}
            separate.before_save(step)
            yield sorted(int(p.stem.split("_")[1]) for p in separate.weights_dir.glob("version_*.safetensors"))

    assert list(saves([2])) == [[1]]  # then killed while saving step 4: resumed from step 2
    assert list(saves([4, 6], resumed_from=2)) == [[1, 3], [3, 5]]
    assert list(saves([8, 10], resumed_from=6)) == [[5, 7], [7, 9]]


def test_importance_weights_and_their_truncated_fraction_by_hand():
    """Behaviour log-probs q from a lagged policy, the trainer's p: w = min(p/q, 2) per token."""
    p = torch.log(torch.tensor([[0.5, 0.9, 0.1], [0.4, 0.4, 0.3]]))
    q = torch.log(torch.tensor([[0.2, 0.6, 0.1], [0.1, 0.5, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = truncated_is_weights(p, q, mask, "token", 2.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 1.5, 1.0], [2.0, 0.8, 0.0]]))
    assert truncated_fraction(p, q, mask, "token", 2.0).item() == pytest.approx(2 / 5)  # 0.5/0.2 and 0.4/0.1
    # sequence level: row 0's ratio 2.5*1.5*1 = 3.75 > 2 (3 tokens cut), row 1's 4*0.8 = 3.2 > 2 (2 tokens)
    assert truncated_fraction(p, q, mask, "sequence", 2.0).item() == 1.0
    assert truncated_fraction(p, q, mask, "sequence", 4.0).item() == pytest.approx(0.0)
    assert math.isclose(truncated_is_weights(p, q, mask, "sequence", 4.0)[1, 0].item(), 3.2, rel_tol=1e-6)


@pytest.mark.parametrize("overrides, fragment", [
    (["algorithm.async.max_lag=-1"], r"algorithm.async.max_lag must be >= 0"),
    (["algorithm.async.max_lag=1"], r"algorithm.async.max_lag=1 needs rollout workers.*generation.placement=separate"),
    (["generation.placement=separate", "generation.workers=0"], r"generation.workers >= 1"),
    (["generation.placement=separate", "generation.tensor_model_parallel_size=3"],
     r"generation.tensor_model_parallel_size=3 must divide the model's attention heads"),
    (["algorithm.async.max_lagg=1"], r"max_lagg"),
])
def test_async_settings_that_cannot_run_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as error:
        load_config("grpo", GRPO + overrides, world_size=1)
    assert "\n" not in str(error.value)


def test_a_lagged_separate_run_is_accepted():
    cfg = load_config("grpo", GRPO + ["generation.placement=separate", "generation.workers=2",
                                      "algorithm.dynamic_sampling.enabled=true",
                                      "generation.tensor_model_parallel_size=2", "algorithm.async.max_lag=4"],
                      world_size=1)
    assert cfg.algorithm["async"].max_lag == 4 and cfg.generation.workers == 2
