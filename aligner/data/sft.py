"""SFT samples: token ids plus a loss mask saying which tokens are trained on.

Conventions:
* A `Sample` has `ids` and an equally long `loss_mask` (1 = trained on). The mask refers to the token at
  the same position; the loader shifts it so that the label `ids[t]` at position `t-1` uses `loss_mask[t]`.
* Chat (`{"messages": [...]}`, roles system/user/assistant/tool): the conversation is rendered with the
  tokenizer's chat template and encoded with `add_special_tokens=False` (a template writes its own bos);
  the loss covers each assistant turn, i.e. the tokens the full rendering adds after the generation prompt
  (for the tiny template: the content and its `<eos>`). This needs a prefix-stable template.
* Input/output (`{"input": ..., "output": ...}`): `[bos] + enc(input) + enc(output) + [eos]` with the loss
  on the output and the eos; the bos is there only if the tokenizer adds one by default (Llama-like).
* Samples longer than `max_length` are truncated (the first `max_length` tokens kept) or dropped. A sample
  with no trained label left (`loss_mask[1:]` all zero) is dropped. The dataset's `stats` counts both.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aligner.data.jsonl import DataError, LoadStats, TokenizedDataset, json_type, read_jsonl
from aligner.data.steerlm import insert_condition

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")  # tool: an environment's observation (aligner.envs)
FORMATS = ("auto", "chat", "input_output")


@dataclass(frozen=True)
class Sample:
    ids: list[int]
    loss_mask: list[int]


# ---- tokenization ----------------------------------------------------------------------------------
def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The conversation as text, through the tokenizer's chat template (with the generation prompt
    after it when `generation_prompt`)."""
    # tokenize=False returns the text; transformers 5 otherwise returns a BatchEncoding by default.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def tokenize_chat(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """`(ids, loss_mask)` of a conversation, with mask 1 exactly on the assistant turns.

    For each assistant message i, the rendering of `messages[:i]` with the generation prompt must be a
    prefix of the rendering of `messages[:i+1]`, which must be a prefix of the whole conversation's
    rendering, both as text and as tokens; otherwise a DataError says which turn breaks it.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"chat data needs a tokenizer with a chat template, and the one at "
                        f"{tokenizer.name_or_path} has none",
                        fix="use a tokenizer with a chat template (tokenizer.path), or plain-text records")
    full_text = render_chat(tokenizer, messages)
    ids = encode_text(tokenizer, full_text)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise DataError("the conversation starts with an assistant turn; expected a system or user message "
                            "before it")
        prompt_text = render_chat(tokenizer, messages[:i], generation_prompt=True)
        turn_text = render_chat(tokenizer, messages[:i + 1])
        if not turn_text.startswith(prompt_text):
            raise DataError(f"the chat template is not prefix-stable at messages[{i}]: the rendering of the messages "
                            f"before it with add_generation_prompt=True ({prompt_text[-40:]!r} at its end) is not a "
                            f"prefix of the rendering through it, so the assistant tokens cannot be located")
        if not full_text.startswith(turn_text):
            raise DataError(f"the chat template is not prefix-stable at messages[{i}]: later messages change how "
                            f"the conversation through messages[{i}] is rendered")
        prompt, turn = encode_text(tokenizer, prompt_text), encode_text(tokenizer, turn_text)
        if turn[:len(prompt)] != prompt or ids[:len(turn)] != turn:
            raise DataError(f"the tokenization is not prefix-stable at messages[{i}]: tokens merge across the start "
                            f"or end of the assistant turn ({prompt_text[-40:]!r} ends the prompt)")
        mask[len(prompt):len(turn)] = [1] * (len(turn) - len(prompt))
    return ids, mask


_ADDS_BOS = weakref.WeakKeyDictionary()  # tokenizer -> adds_bos: asked once, not once per sample (a tokenizer call)


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts its bos first when it encodes text with its default special tokens."""
    known = _ADDS_BOS.get(tokenizer)
    if known is None:
        bos = tokenizer.bos_token_id
        known = _ADDS_BOS[tokenizer] = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    return known


def tokenize_input_output(input: str, output: str, tokenizer) -> tuple[list[int], list[int]]:
    """`(ids, loss_mask)` = `[bos] + enc(input) + enc(output) + [eos]`, mask 1 on the output and the eos."""
    prompt = ([tokenizer.bos_token_id] if adds_bos(tokenizer) else []) + encode_text(tokenizer, input)
    answer = encode_text(tokenizer, output) + [tokenizer.eos_token_id]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


# ---- validation ------------------------------------------------------------------------------------
def detect_format(obj: dict) -> str:
    """"chat" when the record has `messages`, "input_output" when it has `input` or `output`."""
    if "messages" in obj:
        return "chat"
    if "input" in obj or "output" in obj:
        return "input_output"
    raise DataError(f"expected a 'messages' list (chat) or 'input' and 'output' strings, got keys {sorted(obj)}")


def check_messages(messages, key: str = "messages", missing: bool = False, or_string: bool = False) -> list[dict]:
    """A list of {role, content} messages, validated (errors name `key[i]`); `missing` says the
    record had no such key at all, `or_string` that a string would have done too."""
    if not isinstance(messages, list) or not messages:
        got = "no '" + key + "'" if missing else "an empty list" if messages == [] else json_type(messages)
        alternative = "a string or " if or_string else ""
        raise DataError(f"expected '{key}' to be {alternative}a non-empty list of {{role, content}} messages, "
                        f"got {got}")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{key}[{i}]: expected an object with 'role' and 'content', got {json_type(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{key}[{i}]: expected 'role' to be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise DataError(f"{key}[{i}]: expected 'content' to be a string, got {json_type(content)}")
        clean.append({"role": role, "content": content})
    return clean


def check_chat(obj: dict) -> list[dict]:
    """A chat record's messages, with at least one assistant turn to train on."""
    clean = check_messages(obj.get("messages"), missing="messages" not in obj)
    if all(m["role"] != "assistant" for m in clean):
        raise DataError("expected at least one assistant message (the loss is on assistant turns), got none")
    return clean


def _check_input_output(obj: dict) -> tuple[str, str]:
    for key in ("input", "output"):
        if key not in obj:
            raise DataError(f"expected '{key}' (a string), but the record has no '{key}'")
        if not isinstance(obj[key], str):
            raise DataError(f"expected '{key}' to be a string, got {json_type(obj[key])}")
    if not obj["output"]:
        raise DataError("expected a non-empty 'output' (the loss is on it), got an empty string")
    return obj["input"], obj["output"]


def tokenize_record(obj: dict, tokenizer, fmt: str = "auto") -> tuple[list[int], list[int]]:
    """Validate one JSONL record in format `fmt` (or the detected one) and tokenize it."""
    fmt = detect_format(obj) if fmt == "auto" else fmt
    if fmt == "chat":
        return tokenize_chat(check_chat(obj), tokenizer)
    return tokenize_input_output(*_check_input_output(obj), tokenizer)


# ---- loading ---------------------------------------------------------------------------------------
def load_sft_dataset(path: str | Path, tokenizer, fmt: str = "auto", max_length: int = 256,
                     overlong: str = "truncate", prefix: Callable[[dict], list[int]] | None = None) -> TokenizedDataset:
    """Read, validate and tokenize an SFT JSONL file; malformed records raise DataError(`path:line: ...`).
    `prefix(record)` gives ids to put at the start of each sample (after its bos), outside the loss
    (SteerLM's attribute condition)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (a token and its label), got {max_length}")
    samples, records, truncated, dropped = [], 0, 0, 0
    for line_no, obj in read_jsonl(path):
        records += 1
        try:
            ids, mask = tokenize_record(obj, tokenizer, fmt)
            if prefix is not None:
                ids, mask = insert_condition(ids, mask, prefix(obj), tokenizer.bos_token_id)
        except DataError as e:
            raise DataError(f"{path}:{line_no}: {e.what}", fix=e.fix) from None
        cut = len(ids) > max_length
        if cut and overlong == "drop":
            dropped += 1
            continue
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask[1:]):  # nothing left to learn: the first token is never a label
            dropped += 1
            continue
        truncated += cut
        samples.append(Sample(ids, mask))
    stats = LoadStats(records, len(samples), truncated, dropped, max_length)
    log.info("%s: %s", path, stats)
    if not samples:
        raise DataError(f"{path}: none of its {records} records gave a usable sample ({dropped} dropped at "
                        f"max_length={max_length}, overlong={overlong!r})")
    return TokenizedDataset(samples, stats, path)
