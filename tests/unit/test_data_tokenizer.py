"""The tiny byte-level BPE tokenizer and `load_tokenizer`."""
import json
import shutil

import pytest

from aligner.data import DataError, build_tiny_tokenizer, load_tokenizer
from aligner.data.synthetic import corpus
from aligner.data.tokenizer import ROLE_TOKENS, TINY_CHAT_TEMPLATE
from tests.conftest import plain_token_ids


def test_special_token_ids(small_tokenizer):
    assert (small_tokenizer.pad_token_id, small_tokenizer.eos_token_id, small_tokenizer.bos_token_id,
            small_tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert [small_tokenizer.convert_tokens_to_ids(t) for t in ROLE_TOKENS] == [4, 5, 6]
    assert 7 + 256 < len(small_tokenizer) <= 512  # specials, bytes, merges
    # Special tokens written in text are single tokens; plain text gets no bos/eos added.
    assert plain_token_ids(small_tokenizer, "<|user|>hi<eos>")[0] == 4 and \
        plain_token_ids(small_tokenizer, "<|user|>hi<eos>")[-1] == 1
    assert small_tokenizer("12+7=")["input_ids"] == plain_token_ids(small_tokenizer, "12+7=")


@pytest.mark.parametrize("text", ["What is 12+7?", "12+7=19", "  two  spaces\nand\ttabs\n\n",
                                  "héllo wörld, ünïcode → 数字 🙂", "98*76=7448", ""])
def test_round_trip(small_tokenizer, text):
    assert small_tokenizer.decode(plain_token_ids(small_tokenizer, text)) == text


def test_arithmetic_tokenizes_compactly(small_tokenizer):
    pieces = [small_tokenizer.decode([i]) for i in plain_token_ids(small_tokenizer, "What is 12+7?")]
    assert pieces == ["What", " is", " 12", "+", "7", "?"]
    assert [small_tokenizer.decode([i]) for i in plain_token_ids(small_tokenizer, "12+7=19")] == \
        ["12", "+", "7", "=", "19"]


def test_chat_template(small_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+7?"},
                {"role": "assistant", "content": "19"}]
    assert small_tokenizer.chat_template == TINY_CHAT_TEMPLATE
    assert small_tokenizer.apply_chat_template(messages, tokenize=False) == \
        "<|system|>Be brief.<eos><|user|>What is 12+7?<eos><|assistant|>19<eos>"
    assert small_tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True) == \
        "<|system|>Be brief.<eos><|user|>What is 12+7?<eos><|assistant|>"


def test_deterministic(tmp_path):
    texts = corpus(100, seed=3)
    a = build_tiny_tokenizer(texts, tmp_path / "a", vocab_size=300)
    b = build_tiny_tokenizer(iter(texts), tmp_path / "b", vocab_size=300)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    c = build_tiny_tokenizer(["zzzz qqqq"] * 5, tmp_path / "c", vocab_size=300)
    assert (a / "tokenizer.json").read_bytes() != (c / "tokenizer.json").read_bytes()


def test_reload_is_identical(small_tokenizer, tmp_path):
    small_tokenizer.save_pretrained(str(tmp_path))
    again = load_tokenizer(tmp_path)
    assert again.get_vocab() == small_tokenizer.get_vocab()
    assert again.chat_template == small_tokenizer.chat_template
    assert again.all_special_tokens == small_tokenizer.all_special_tokens
    text = "<|user|>What is 3*4?<eos><|assistant|>12<eos>"
    assert plain_token_ids(again, text) == plain_token_ids(small_tokenizer, text)


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        build_tiny_tokenizer(["a b"], tmp_path, vocab_size=100)


def _copy_without(tokenizer_dir, tmp_path, key):
    out = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config[key]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_missing_pad_falls_back_to_eos(small_tokenizer_dir, tmp_path):
    tok = load_tokenizer(_copy_without(small_tokenizer_dir, tmp_path, "pad_token"))
    assert tok.pad_token_id == tok.eos_token_id == 1


def test_missing_eos_is_an_error(small_tokenizer_dir, tmp_path):
    path = _copy_without(small_tokenizer_dir, tmp_path, "eos_token")
    with pytest.raises(DataError, match="no eos token") as e:
        load_tokenizer(path)
    assert str(path) in str(e.value)


def test_load_errors_name_the_path(tmp_path):
    for path, what in [(tmp_path / "nope", "does not exist"), (tmp_path, "holds none of")]:
        with pytest.raises(DataError, match=what) as e:
            load_tokenizer(path)
        assert str(path) in str(e.value)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(DataError, match="cannot load") as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value)
