"""JSONL reading, synthetic data, SFT tokenization (chat and input/output) and dataset loading."""
import logging

import pytest

from aligner.data import (DataError, detect_format, load_sft_dataset, load_tokenizer, read_jsonl, tokenize_chat,
                          tokenize_input_output)
from aligner.data import synthetic
from tests.conftest import plain_token_ids, write_jsonl_lines

LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHAT = [{"role": "user", "content": "What is 12+7?"}, {"role": "assistant", "content": "19"}]
MULTI = [{"role": "system", "content": "Be brief."}, *CHAT, {"role": "user", "content": "And 3*4?"},
         {"role": "assistant", "content": "12"}]


def masked_runs(tok, ids, mask):
    """The decoded text of each contiguous run of mask-1 tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    return [tok.decode(r) for r in runs + ([current] if current else [])]


# ---- jsonl -----------------------------------------------------------------------------------------
def test_read_jsonl_skips_blank_lines(tmp_path):
    path = write_jsonl_lines(tmp_path / "a.jsonl", [{"a": 1}, "", "   ", {"b": 2}])
    assert list(read_jsonl(path)) == [(1, {"a": 1}), (4, {"b": 2})]


@pytest.mark.parametrize("line,expected", [("{bad json", "invalid JSON"), ("[1, 2]", "got an array"),
                                           ('"text"', "got a string"), ("3", "got a number")])
def test_read_jsonl_errors_name_file_and_line(tmp_path, line, expected):
    path = write_jsonl_lines(tmp_path / "a.jsonl", [{"a": 1}, "", line])
    with pytest.raises(DataError, match=expected) as e:
        list(read_jsonl(path))
    assert str(e.value).startswith(f"{path}:3: expected ")


def test_read_jsonl_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file") as e:
        list(read_jsonl(tmp_path / "missing.jsonl"))
    assert str(tmp_path / "missing.jsonl") in str(e.value)


# ---- synthetic -------------------------------------------------------------------------------------
def test_arithmetic_problems_are_deterministic_and_correct():
    problems = synthetic.arithmetic_problems(200, seed=5, max_operand=20)
    assert problems == synthetic.arithmetic_problems(200, seed=5, max_operand=20)
    assert problems != synthetic.arithmetic_problems(200, seed=6, max_operand=20)
    assert {p["question"][:-1].strip("0123456789") for p in problems} == {"+", "-", "*"}
    for p in problems:
        assert p["question"].endswith("=") and int(p["answer"]) >= 0
        assert eval(p["question"][:-1]) == int(p["answer"])  # noqa: S307 - digits and one operator
    assert {p["question"][:-1].strip("0123456789") for p in synthetic.arithmetic_problems(50, 0, ops="+")} == {"+"}


def test_writers(tmp_path):
    chat = [obj for _, obj in read_jsonl(synthetic.write_sft_chat(tmp_path / "d" / "chat.jsonl", 3, seed=1))]
    plain = [obj for _, obj in read_jsonl(synthetic.write_input_output(tmp_path / "plain.jsonl", 3, seed=1))]
    problems = synthetic.arithmetic_problems(3, seed=1)
    assert plain == [{"input": p["question"], "output": p["answer"]} for p in problems]
    assert chat[0] == {"messages": [{"role": "user", "content": f"What is {problems[0]['question'][:-1]}?"},
                                    {"role": "assistant", "content": problems[0]["answer"]}]}


def test_operand_range_and_the_calculator_conversations(tmp_path):
    problems = synthetic.arithmetic_problems(300, seed=3, max_operand=99, ops="*", min_operand=10)
    assert all(10 <= int(x) <= 99 for p in problems for x in p["question"][:-1].split("*"))
    assert synthetic.arithmetic_problems(50, 4, 9) == synthetic.arithmetic_problems(50, 4, 9, min_operand=0)
    with pytest.raises(ValueError, match="min_operand <= max_operand"):
        synthetic.arithmetic_problems(1, 0, max_operand=5, min_operand=6)
    assert synthetic.calculator_messages({"question": "12*34=", "answer": "408"}) == [
        {"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": "<calc>12*34</calc>"},
        {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]
    rows = [obj["messages"] for _, obj in read_jsonl(synthetic.write_calculator_chat(tmp_path / "mix.jsonl", problems,
                                                                                    tool_fraction=0.2, seed=1))]
    tools = [m for m in rows if len(m) == 4]
    assert 30 < len(tools) < 90 and tools[0] == synthetic.calculator_messages(problems[rows.index(tools[0])])
    assert all(m[1]["content"] == f"It is {p['answer']}" for m, p in zip(rows, problems) if len(m) == 2)
    with pytest.raises(ValueError, match="tool_fraction"):
        synthetic.write_calculator_chat(tmp_path / "x.jsonl", problems, tool_fraction=1.5)
    prompts = [obj for _, obj in read_jsonl(synthetic.write_prompts(tmp_path / "p.jsonl", problems[:2]))]
    assert prompts[0] == {"prompt": [{"role": "user", "content": f"What is {problems[0]['question'][:-1]}?"}],
                          "answer": problems[0]["answer"]}


def test_tool_turns_train_on_the_token_layout_of_the_episodes(tokenizer):
    """A calculator conversation tokenizes as the episode runner lays out its episode (aligner/envs/episodes.py):
    the prompt, the first turn and its eos, the observation with the next generation prompt, the answer and its
    eos; the loss is on the two assistant turns only."""
    from aligner.envs.episodes import Renderer

    messages = synthetic.calculator_messages({"question": "47*58=", "answer": "2726"})
    ids, mask = tokenize_chat(messages, tokenizer)
    renderer, eos = Renderer(tokenizer), [tokenizer.eos_token_id]
    call, tool = plain_token_ids(tokenizer, "<calc>47*58</calc>") + eos, renderer.observation_ids("2726")
    answer = plain_token_ids(tokenizer, "2726") + eos
    prompt = renderer.prompt_ids(messages[:1])
    assert ids == prompt + call + tool + answer
    assert mask == [0] * len(prompt) + [1] * len(call) + [0] * len(tool) + [1] * len(answer)


# ---- tokenize_chat ---------------------------------------------------------------------------------
def test_chat_mask_is_the_assistant_content_and_eos(small_tokenizer):
    ids, mask = tokenize_chat(CHAT, small_tokenizer)
    assert ids == plain_token_ids(small_tokenizer, "<|user|>What is 12+7?<eos><|assistant|>19<eos>")
    answer = len(plain_token_ids(small_tokenizer, "19")) + 1
    assert mask == [0] * (len(ids) - answer) + [1] * answer
    assert masked_runs(small_tokenizer, ids, mask) == ["19<eos>"]


def test_multi_turn_masks_every_assistant_turn(small_tokenizer):
    ids, mask = tokenize_chat(MULTI, small_tokenizer)
    assert small_tokenizer.decode(ids) == \
        "<|system|>Be brief.<eos><|user|>What is 12+7?<eos><|assistant|>19<eos><|user|>And 3*4?<eos><|assistant|>12<eos>"
    assert masked_runs(small_tokenizer, ids, mask) == ["19<eos>", "12<eos>"]
    # a trailing user turn is context only
    ids2, mask2 = tokenize_chat(MULTI + [{"role": "user", "content": "Thanks"}], small_tokenizer)
    assert ids2[:len(ids)] == ids and mask2 == mask + [0] * (len(ids2) - len(ids))


def test_llama3_style_template(small_tokenizer_dir):
    tok = load_tokenizer(small_tokenizer_dir)  # a private copy: the template and tokens change below
    tok.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    tok.chat_template = LLAMA3_STYLE
    ids, mask = tokenize_chat(MULTI, tok)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert masked_runs(tok, ids, mask) == ["19<|eot_id|>", "12<|eot_id|>"]
    context = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert context.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("template,expected", [
    # the generation prompt adds a newline that the assistant turn does not have
    ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<eos>' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}", "chat template is not prefix-stable"),
    # earlier assistant turns are rendered without their content (like templates that drop reasoning)
    ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['role'] != 'assistant' or loop.last %}"
     "{{ m['content'] }}{% endif %}{{ '<eos>' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}", "later messages change"),
    # the prompt ends mid-word, so its last token merges with the answer ("1" + "2" -> "12")
    ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<eos>' }}{% endfor %}"
     "{% if add_generation_prompt %}{{ '<|assistant|>1' }}{% endif %}", "tokenization is not prefix-stable"),
])
def test_unstable_templates_are_rejected(small_tokenizer_dir, template, expected):
    tok = load_tokenizer(small_tokenizer_dir)
    tok.chat_template = template
    messages = MULTI if "later" in expected else [{"role": "user", "content": "x"},
                                                  {"role": "assistant", "content": "12"}]
    with pytest.raises(DataError, match=expected):
        tokenize_chat(messages, tok)


def test_assistant_first_is_rejected(small_tokenizer):
    with pytest.raises(DataError, match="starts with an assistant turn"):
        tokenize_chat(CHAT[1:], small_tokenizer)


# ---- input/output ----------------------------------------------------------------------------------
def test_tokenize_input_output(small_tokenizer):
    ids, mask = tokenize_input_output("12+7=", "19", small_tokenizer)
    prompt, answer = plain_token_ids(small_tokenizer, "12+7="), plain_token_ids(small_tokenizer, "19")
    assert ids == prompt + answer + [small_tokenizer.eos_token_id]
    assert mask == [0] * len(prompt) + [1] * (len(answer) + 1)
    assert masked_runs(small_tokenizer, ids, mask) == ["19<eos>"]


def test_detect_format():
    assert detect_format({"messages": []}) == "chat"
    assert detect_format({"input": "a", "output": "b"}) == "input_output"
    assert detect_format({"output": "b"}) == "input_output"
    with pytest.raises(DataError, match="expected a 'messages' list"):
        detect_format({"text": "a"})


# ---- load_sft_dataset ------------------------------------------------------------------------------
def test_load_mixed_formats(small_tokenizer, tmp_path):
    path = write_jsonl_lines(tmp_path / "train.jsonl", [{"messages": CHAT}, "", {"input": "12+7=", "output": "19"}])
    data = load_sft_dataset(path, small_tokenizer)
    assert len(data) == 2 and data.stats.records == 2
    assert (data[0].ids, data[0].loss_mask) == tokenize_chat(CHAT, small_tokenizer)
    assert (data[1].ids, data[1].loss_mask) == tokenize_input_output("12+7=", "19", small_tokenizer)
    assert [s.ids for s in data] == [data[0].ids, data[1].ids]


@pytest.mark.parametrize("record,fmt,expected", [
    ({"text": "hi"}, "auto", "expected a 'messages' list"),
    ({"messages": []}, "auto", "non-empty list .* got an empty list"),
    ({"messages": "hi"}, "auto", "got a string"),
    ({"input": "1+1="}, "auto", "no 'output'"),
    ({"input": "1+1=", "output": 2}, "auto", "'output' to be a string, got a number"),
    ({"input": "1+1=", "output": ""}, "auto", "non-empty 'output'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "auto", r"messages\[0\]: expected 'role'"),
    ({"messages": [{"role": "user", "content": None}]}, "auto", r"messages\[0\]: .*got null"),
    ({"messages": ["hi"]}, "auto", r"messages\[0\]: expected an object"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "auto", "at least one assistant message"),
    ({"input": "1+1=", "output": "2"}, "chat", "no 'messages'"),
    ({"messages": CHAT}, "input_output", "no 'input'"),
])
def test_invalid_records_name_file_and_line(small_tokenizer, tmp_path, record, fmt, expected):
    good = {"input": "1+1=", "output": "2"} if fmt == "input_output" else {"messages": CHAT}
    path = write_jsonl_lines(tmp_path / "train.jsonl", [good, record])
    with pytest.raises(DataError, match=expected) as e:
        load_sft_dataset(path, small_tokenizer, fmt=fmt)
    assert str(e.value).startswith(f"{path}:2: ")


def test_chat_needs_a_template(small_tokenizer_dir, tmp_path):
    tok = load_tokenizer(small_tokenizer_dir)
    tok.chat_template = None
    path = write_jsonl_lines(tmp_path / "train.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=f"^{path}:1: .*chat template"):
        load_sft_dataset(path, tok)


def test_overlong_truncate_and_drop(small_tokenizer, tmp_path, caplog):
    short = {"input": "1+1=", "output": "2"}
    long_output = {"input": "1+1=", "output": " ".join(str(i) for i in range(30))}
    long_input = {"input": "What is " * 30, "output": "2"}  # cut before the output: nothing left to learn
    path = write_jsonl_lines(tmp_path / "train.jsonl", [short, long_output, long_input])
    max_length = 12
    assert len(tokenize_input_output(short["input"], short["output"], small_tokenizer)[0]) <= max_length
    with caplog.at_level(logging.INFO, logger="aligner.data.sft"):
        data = load_sft_dataset(path, small_tokenizer, max_length=max_length, overlong="truncate")
    assert (data.stats.samples, data.stats.truncated, data.stats.dropped) == (2, 1, 1)
    full_ids, full_mask = tokenize_input_output(long_output["input"], long_output["output"], small_tokenizer)
    assert (data[1].ids, data[1].loss_mask) == (full_ids[:max_length], full_mask[:max_length])
    assert f"{path}: 2 samples, 1 truncated to 12 tokens, 1 dropped" in caplog.messages

    data = load_sft_dataset(path, small_tokenizer, max_length=max_length, overlong="drop")
    assert (data.stats.samples, data.stats.truncated, data.stats.dropped) == (1, 0, 2)
    assert data[0].ids == tokenize_input_output("1+1=", "2", small_tokenizer)[0]


def test_no_usable_samples(small_tokenizer, tmp_path):
    path = write_jsonl_lines(tmp_path / "train.jsonl", [{"input": "What is " * 30, "output": "2"}])
    with pytest.raises(DataError, match="none of its 1 records"):
        load_sft_dataset(path, small_tokenizer, max_length=8)


def test_synthetic_files_load(small_tokenizer, tmp_path):
    chat = load_sft_dataset(synthetic.write_sft_chat(tmp_path / "chat.jsonl", 100, seed=2), small_tokenizer,
                            max_length=32)
    plain = load_sft_dataset(synthetic.write_input_output(tmp_path / "io.jsonl", 100, seed=2), small_tokenizer,
                             max_length=32)
    assert len(chat) == len(plain) == 100 and chat.stats.truncated == plain.stats.truncated == 0
    answers = [p["answer"] for p in synthetic.arithmetic_problems(100, seed=2)]
    for data in (chat, plain):
        assert [masked_runs(small_tokenizer, s.ids, s.loss_mask) for s in data] == [[a + "<eos>"] for a in answers]
