"""Rejection sampling's pure parts: the choice of winners by hand (ties, unscored samples, top_n above the
scored count), the SFT records `aligner rs-generate` writes and its override names."""
from __future__ import annotations

import pytest

from aligner.algorithms.online.rs_select import flat_winners, select_winners


def test_select_winners_by_hand():
    assert select_winners([[0.5, 1.0, 0.2, 0.9]], 2) == [[1, 3]]  # the best first
    assert select_winners([[0.5, 1.0, 1.0, 1.0]], 2) == [[1, 2]]  # ties: the lower sample index
    assert select_winners([[2.0, 2.0, 2.0]], 1) == [[0]]
    assert select_winners([[None, -5.0, None, -7.0]], 1) == [[1]]  # unscored never wins, even over a low score
    assert select_winners([[float("nan"), 0.0]], 1) == [[1]]  # NaN counts as unscored
    assert select_winners([[3.0, None, 1.0, None]], 3) == [[0, 2]]  # fewer scored than top_n: only those
    assert select_winners([[None, None], [1.0, 2.0]], 2) == [[], [1, 0]]  # a prompt without a score keeps nothing
    assert flat_winners([1.0, None, 0.0, 2.0, None, None], 2, 1) == [0, 3]  # flat indices, prompt after prompt
    with pytest.raises(ValueError):
        select_winners([[1.0]], 0)
    with pytest.raises(ValueError):
        flat_winners([1.0, 2.0, 3.0], 2, 1)


def test_rs_generate_records_and_overrides():
    from aligner.algorithms.online.rs_generate import hydra_overrides, sft_record
    from aligner.errors import UsageError

    chat = [{"role": "user", "content": "1+2="}]
    assert sft_record(chat, "3", 1.0) == {"messages": chat + [{"role": "assistant", "content": "3"}], "reward": 1.0}
    assert sft_record("1+2=", "3", 0.5) == {"input": "1+2=", "output": "3", "reward": 0.5}
    assert sft_record("1+2=", "", 0.5) is None  # an SFT output cannot be empty
    assert hydra_overrides(["rs.top_n=2", "batch_size=4", "seed=3"]) == ["rs.top_n=2", "generation.batch_size=4",
                                                                          "trainer.seed=3"]
    with pytest.raises(UsageError, match="optim.lr"):
        hydra_overrides(["optim.lr=1"])
