"""The reward model's data formats: preference pairs (text, chat, conversation) tokenize alike, regression
labels and their masks, bad pairs named by file and line, overlong pairs dropped or truncated."""
from __future__ import annotations

import pytest

from tests.conftest import write_jsonl_lines


def test_pair_formats_tokenize_alike(tokenizer, tmp_path):
    from aligner.data.preference_rm import encode_for_reward, load_rm_dataset

    user = [{"role": "user", "content": "What is 2+3?"}]
    records = [
        {"prompt": "2+3=", "chosen": "5", "rejected": "6", "margin": 2},
        {"prompt": user, "chosen": "5", "rejected": "6"},
        {"chosen": user + [{"role": "assistant", "content": "5"}], "rejected": user + [{"role": "assistant", "content": "6"}]},
    ]
    data = load_rm_dataset(write_jsonl_lines(tmp_path / "p.jsonl", records), tokenizer, "pairs")
    text, chat, conversation = data.samples
    assert text.chosen == encode_for_reward(tokenizer, "2+3=5") and text.margin == 2.0
    assert text.chosen[-1] == tokenizer.eos_token_id
    assert chat == conversation and chat.margin == 0.0
    rendered = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "5"}], tokenize=False)
    assert chat.chosen == encode_for_reward(tokenizer, rendered)
    assert chat.chosen.count(tokenizer.eos_token_id) == 2  # the template's eos is not doubled


def test_regression_labels_and_masks(tokenizer, tmp_path):
    from aligner.data.preference_rm import load_rm_dataset

    records = [
        {"prompt": "q", "response": "a", "labels": {"helpfulness": 3, "correctness": None}},
        {"prompt": "q", "response": "b", "helpfulness": 1, "correctness": 2.5},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"}], "labels": [None, 4]},
        {"prompt": "q", "response": "d", "labels": {}},  # nothing labelled: dropped
    ]
    data = load_rm_dataset(write_jsonl_lines(tmp_path / "r.jsonl", records), tokenizer, "regression",
                           ["helpfulness", "correctness"])
    assert [(s.labels, s.label_mask) for s in data.samples] == [
        ([3.0, 0.0], [1.0, 0.0]), ([1.0, 2.5], [1.0, 1.0]), ([0.0, 4.0], [0.0, 1.0])]
    assert data.stats.dropped == 1


@pytest.mark.parametrize("record, message", [
    ({"prompt": "q", "chosen": "a"}, "expected 'rejected'"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' to be a string or a message list, got a number"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}, "'margin' to be a finite number"),
    ('{"prompt": "q"', "invalid JSON"),
])
def test_bad_pairs_name_file_and_line(tokenizer, tmp_path, record, message):
    from aligner.data.jsonl import DataError
    from aligner.data.preference_rm import load_rm_dataset

    path = write_jsonl_lines(tmp_path / "bad.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(DataError, match=f"{path}:2: .*{message}"):
        load_rm_dataset(path, tokenizer, "pairs")


def test_overlong_pairs_are_dropped_or_truncated(tokenizer, tmp_path):
    from aligner.data.preference_rm import load_rm_dataset

    path = write_jsonl_lines(tmp_path / "long.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"},
                                            {"prompt": "q" * 50, "chosen": "a", "rejected": "b"}])
    assert len(load_rm_dataset(path, tokenizer, "pairs", max_length=8)) == 1
    kept = load_rm_dataset(path, tokenizer, "pairs", max_length=8, overlong="truncate")
    assert len(kept) == 2 and kept.stats.truncated == 1 and len(kept[1].chosen) == 8
