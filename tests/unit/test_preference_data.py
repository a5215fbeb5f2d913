"""Preference JSONL: text and chat pairs, implicit prompts, KTO records, the token-level
prompt/response boundary check, and the errors for empty, identical and malformed records."""
import pytest

from aligner.data.jsonl import DataError
from aligner.data.preference import (load_preference_dataset, load_unpaired_dataset, synthetic_preferences,
                                     synthetic_unpaired, write_jsonl)
from tests.conftest import plain_token_ids, write_jsonl_lines


def test_text_pairs(tokenizer, tmp_path):
    path = write_jsonl_lines(tmp_path / "p.jsonl", [{"prompt": "What is 3+4?", "chosen": " 7", "rejected": " 8"}])
    pair = load_preference_dataset(path, tokenizer)[0]
    prompt = plain_token_ids(tokenizer, "What is 3+4?")
    assert pair.chosen == plain_token_ids(tokenizer, "What is 3+4? 7") + [tokenizer.eos_token_id]
    assert pair.chosen[:pair.chosen_start] == prompt and pair.rejected[:pair.rejected_start] == prompt
    assert tokenizer.decode(pair.rejected[pair.rejected_start:]) == " 8<eos>"
    assert pair.chosen_reward is None and pair.reference is None


def test_chat_pairs_and_implicit_prompt(tokenizer, tmp_path):
    user = {"role": "user", "content": "What is 3+4?"}
    explicit = {"prompt": [user], "chosen": "7", "rejected": [{"role": "assistant", "content": "8"}]}
    whole = {"chosen": [user, {"role": "assistant", "content": "7"}],
             "rejected": [user, {"role": "assistant", "content": "8"}]}
    a, b = load_preference_dataset(write_jsonl_lines(tmp_path / "c.jsonl", [explicit, whole]), tokenizer)
    assert a == b
    assert tokenizer.decode(a.chosen) == "<|user|>What is 3+4?<eos><|assistant|>7<eos>"
    assert tokenizer.decode(a.chosen[a.chosen_start:]) == "7<eos>"  # the template closes the turn


def test_rewards_for_reward_aware_losses(tokenizer, tmp_path):
    record = {"prompt": "Q: ", "chosen": "a", "rejected": "b", "chosen_reward": 2, "rejected_reward": -1.5}
    pair = load_preference_dataset(write_jsonl_lines(tmp_path / "r.jsonl", [record]), tokenizer, rewards=True)[0]
    assert (pair.chosen_reward, pair.rejected_reward) == (2.0, -1.5)
    del record["rejected_reward"]
    with pytest.raises(DataError, match=r"r2.jsonl:1: expected 'rejected_reward' to be a finite number"):
        load_preference_dataset(write_jsonl_lines(tmp_path / "r2.jsonl", [record]), tokenizer, rewards=True)


def test_a_merge_across_the_prompt_boundary_is_reported(tokenizer, tmp_path):
    # the tiny BPE has one token for every number 0..99, so "What is 1" + "2" encodes "12" as one token
    assert len(plain_token_ids(tokenizer, "12")) == 1
    path = write_jsonl_lines(tmp_path / "m.jsonl", [{"prompt": "What is 3+4?", "chosen": " 7", "rejected": " 8"},
                                         {"prompt": "What is 1", "chosen": "2", "rejected": "3"}])
    with pytest.raises(DataError, match=r"m.jsonl:2: 'chosen': the tokenizer merges the end of the prompt with "
                                        r"the start of the response.*= ' 1', but the whole sequence has .* = ' 12"):
        load_preference_dataset(path, tokenizer)


@pytest.mark.parametrize("record, message", [
    ({"prompt": "Q ", "chosen": "", "rejected": "b"}, "'chosen' is empty"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' is empty"),
    ({"prompt": "Q ", "chosen": "a", "rejected": "a"}, "'chosen' and 'rejected' are identical"),
    ({"prompt": [{"role": "user", "content": "Q"}], "chosen": [], "rejected": "b"}, "got an empty list"),
    ({"prompt": "Q ", "chosen": "a"}, "expected 'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "expected 'prompt'"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "expected 'prompt' to be a string or a message list, got a number"),
    ({"prompt": "Q ", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
     "data.format=input_output|'prompt' must be one too"),
    ({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "must start with an assistant message"),
])
def test_bad_records_fail_with_file_and_line(tokenizer, tmp_path, record, message):
    path = write_jsonl_lines(tmp_path / "bad.jsonl", [{"prompt": "Q ", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*({message})"):
        load_preference_dataset(path, tokenizer)


def test_format_is_enforced(tokenizer, tmp_path):
    path = write_jsonl_lines(tmp_path / "t.jsonl", [{"prompt": "Q ", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match="t.jsonl:1: data.format=chat expects 'prompt' to be a message list"):
        load_preference_dataset(path, tokenizer, fmt="chat")


def test_overlong_pairs_are_dropped_or_truncated(tokenizer, tmp_path):
    long = " 1+2+3+4+5+6+7+8+9"
    path = write_jsonl_lines(tmp_path / "o.jsonl", [{"prompt": "Q:", "chosen": long, "rejected": " 9" + long[2:]},
                                         {"prompt": "Q ", "chosen": "a", "rejected": "b"}])
    dropped = load_preference_dataset(path, tokenizer, max_length=8)
    assert len(dropped) == 1 and dropped.stats.dropped == 1
    truncated = load_preference_dataset(path, tokenizer, max_length=8, overlong="truncate")
    assert len(truncated) == 2 and truncated.stats.truncated == 1
    assert len(truncated[0].chosen) == len(truncated[0].rejected) == 8
    same = write_jsonl_lines(tmp_path / "same.jsonl", [{"prompt": "Q:", "chosen": long, "rejected": long + "+1"}])
    with pytest.raises(DataError, match="none of its 1 records gave a usable sample"):
        # truncated to 8 tokens, both sides are the same: the pair no longer differs and is dropped
        load_preference_dataset(same, tokenizer, max_length=8, overlong="truncate")


def test_unpaired_records_and_their_kl_partners(tokenizer, tmp_path):
    user = [{"role": "user", "content": "What is 3+4?"}]
    path = write_jsonl_lines(tmp_path / "k.jsonl", [{"prompt": user, "completion": "7", "label": True},
                                         {"prompt": "Q ", "completion": "nope", "label": False}])
    a, b = load_unpaired_dataset(path, tokenizer)
    assert a.desirable and not b.desirable
    assert tokenizer.decode(a.ids[a.start:]) == "7<eos>"
    # sample i's mismatched sequence: its own prompt + the next sample's completion
    assert a.kl_ids == a.ids[:a.start] + b.ids[b.start:] and b.kl_ids == b.ids[:b.start] + a.ids[a.start:]
    bad = write_jsonl_lines(tmp_path / "k2.jsonl", [{"prompt": "Q ", "completion": "x", "label": 1}])
    with pytest.raises(DataError, match="k2.jsonl:1: expected 'label' to be true .* got 1"):
        load_unpaired_dataset(bad, tokenizer)


def test_synthetic_task_is_valid_and_deterministic(tokenizer, tmp_path):
    pairs = synthetic_preferences(50, seed=3)
    assert pairs == synthetic_preferences(50, seed=3) and pairs != synthetic_preferences(50, seed=4)
    for p in pairs:
        a, b = (int(p["prompt"][0]["content"][8:-1].split("+")[i]) for i in (0, 1))
        assert int(p["chosen"]) == a + b != int(p["rejected"])
    assert len(load_preference_dataset(write_jsonl(tmp_path / "s.jsonl", pairs), tokenizer)) == 50
    unpaired = synthetic_unpaired(50, seed=3)
    assert {r["label"] for r in unpaired} == {True, False}
    assert len(load_unpaired_dataset(write_jsonl(tmp_path / "u.jsonl", unpaired), tokenizer)) == 50
