"""RL prompt datasets: text and chat prompts tokenized as SFT data is, the record's other fields kept for
the reward functions, malformed records failing with file:line, over-long prompts dropped or refused, and
the synthetic arithmetic prompts."""
from __future__ import annotations

import logging

import pytest

from aligner.data import DataError, load_tokenizer
from aligner.data.prompts import Prompt, load_prompt_dataset
from aligner.data.synthetic import arithmetic_problems, chat_messages, write_arithmetic_prompts
from aligner.rewards.functions import arithmetic_answer
from tests.conftest import plain_token_ids, write_jsonl_lines

USER = [{"role": "user", "content": "What is 12+7?"}]


def test_text_and_chat_prompts(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, *USER]
    path = write_jsonl_lines(tmp_path / "p.jsonl", [
        {"prompt": "12+7=", "answer": "19", "id": 3},
        "",
        {"prompt": chat, "answer": 19, "tests": ["assert f() == 19"]},
    ])
    text, conversation = load_prompt_dataset(path, tokenizer, max_length=64)
    assert text == Prompt(plain_token_ids(tokenizer, "12+7="), "12+7=", {"answer": "19", "id": 3}, f"{path}:1")
    assert conversation.text == "<|system|>Be brief.<eos><|user|>What is 12+7?<eos><|assistant|>"
    assert conversation.ids == tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert conversation.ids == plain_token_ids(tokenizer, conversation.text)
    assert conversation.fields == {"answer": 19, "tests": ["assert f() == 19"]}
    assert conversation.source == f"{path}:3"


def test_a_tokenizer_that_adds_bos(tmp_path, small_tokenizer_dir):
    """Text prompts get the bos the tokenizer adds by default (as SFT input/output data does); a chat
    template writes its own."""
    from tokenizers.processors import TemplateProcessing

    tok = load_tokenizer(small_tokenizer_dir)  # a private copy: its post-processor and template change below
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A",
                                                              special_tokens=[("<bos>", tok.bos_token_id)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    path = write_jsonl_lines(tmp_path / "p.jsonl", [{"prompt": "12+7="}, {"prompt": USER}])
    text, chat = load_prompt_dataset(path, tok, max_length=64)
    assert text.ids == [tok.bos_token_id] + plain_token_ids(tok, "12+7=")
    assert chat.ids[0] == tok.bos_token_id and chat.ids.count(tok.bos_token_id) == 1
    assert chat.text == "<bos><|user|>What is 12+7?<eos><|assistant|>"


@pytest.mark.parametrize("line, expected", [
    ("{bad json", "expected one JSON object per line, got invalid JSON"),
    ({"question": "12+7="}, "expected 'prompt' (a string or a list of {role, content} messages), but the record "
                            "has none (keys: ['question'])"),
    ({"prompt": 3}, "expected 'prompt' to be a string or a list of {role, content} messages, got a number"),
    ({"prompt": {"role": "user"}}, "expected 'prompt' to be a string or a list of {role, content} messages, "
                                   "got an object"),
    ({"prompt": ""}, "expected a non-empty 'prompt', got an empty string"),
    ({"prompt": []}, "expected 'prompt' to be a string or a non-empty list of {role, content} messages, got an "
                     "empty list"),
    ({"prompt": [{"content": "hi"}]}, "prompt[0]: expected 'role' to be one of system, user, assistant, tool, got None"),
    ({"prompt": [{"role": "user"}]}, "prompt[0]: expected 'content' to be a string, got null"),
    ({"prompt": ["hi"]}, "prompt[0]: expected an object with 'role' and 'content', got a string"),
    ({"prompt": [*USER, {"role": "assistant", "content": "19"}]}, "expected the last message of 'prompt' to be a "
                                                                  "user or system turn"),
])
def test_bad_records_name_file_and_line(tmp_path, tokenizer, line, expected):
    path = write_jsonl_lines(tmp_path / "p.jsonl", [{"prompt": "1+1="}, line])
    with pytest.raises(DataError) as e:
        load_prompt_dataset(path, tokenizer, max_length=64)
    assert str(e.value).startswith(f"{path}:2: ")
    assert expected in str(e.value)


def test_chat_prompts_need_a_chat_template(tmp_path, small_tokenizer_dir):
    tok = load_tokenizer(small_tokenizer_dir)
    tok.chat_template = None
    path = write_jsonl_lines(tmp_path / "p.jsonl", [{"prompt": USER}])
    with pytest.raises(DataError, match=f"^{path}:1: chat prompts need a tokenizer with a chat template"):
        load_prompt_dataset(path, tok, max_length=64)


def test_overlong_prompts_are_dropped_or_refused(tmp_path, tokenizer, caplog):
    short, long = "1+1=", "What is " + "12+7 and " * 20 + "3?"
    limit = len(plain_token_ids(tokenizer, short)) + 2
    n_long = len(plain_token_ids(tokenizer, long))
    assert n_long > limit
    path = write_jsonl_lines(tmp_path / "p.jsonl", [{"prompt": short}, {"prompt": long}, {"prompt": short, "k": 1}])
    with caplog.at_level(logging.INFO, logger="aligner.data.prompts"):
        prompts = load_prompt_dataset(path, tokenizer, max_length=limit)
    assert [p.source for p in prompts] == [f"{path}:1", f"{path}:3"]
    assert f"2 prompts, 1 longer than {limit} tokens dropped" in caplog.text
    with pytest.raises(DataError, match=f"^{path}:2: the prompt has {n_long} tokens, more than max_length={limit}"):
        load_prompt_dataset(path, tokenizer, max_length=limit, overlong="error")
    only_long = write_jsonl_lines(tmp_path / "long.jsonl", [{"prompt": long}] * 2)
    with pytest.raises(DataError, match=f"no prompt to train on: all 2 prompts are longer than max_length={limit}"):
        load_prompt_dataset(only_long, tokenizer, max_length=limit)
    empty = write_jsonl_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match="no prompt to train on: it holds no records"):
        load_prompt_dataset(empty, tokenizer, max_length=limit)
    with pytest.raises(ValueError, match="overlong must be one of drop, error, got 'truncate'"):
        load_prompt_dataset(path, tokenizer, max_length=limit, overlong="truncate")


@pytest.mark.parametrize("chat", [True, False])
def test_arithmetic_prompts(tmp_path, tokenizer, chat):
    path = write_arithmetic_prompts(tmp_path / "arith.jsonl", 20, seed=4, chat=chat)
    prompts = load_prompt_dataset(path, tokenizer, max_length=64)
    problems = arithmetic_problems(20, seed=4)
    assert [p.fields for p in prompts] == [{"answer": q["answer"]} for q in problems]
    first = problems[0]
    if chat:
        assert prompts[0].ids == tokenizer.apply_chat_template(chat_messages(first)[:1],
                                                               add_generation_prompt=True)["input_ids"]
    else:
        assert prompts[0].text == first["question"]
    assert all(arithmetic_answer(p.text, p.fields["answer"] + "\n", **p.fields) == 1.0 for p in prompts)
