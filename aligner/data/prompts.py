"""Prompt datasets for online RL (`aligner train grpo|reinforce`): what the policy is asked, and what the
reward functions need to score its answer.

Records, one JSON object per line (`aligner.data.jsonl`): `{"prompt": str | [messages], ...}`. Every other
field (`answer`, `pattern`, `tests`, ...) is kept as it is in `Prompt.fields` and passed to the reward
functions (`aligner.rewards`).

Tokenization follows the SFT and preference data (`aligner.data.sft`), so that a policy trained on those
is asked in the same layout:
* text: `[bos] + enc(prompt)`, encoded with `add_special_tokens=False` (the bos only if the tokenizer adds
  one by default, Llama-like); `Prompt.text` is the prompt as written.
* chat (a list of {role, content} messages, roles system/user/assistant, the last one not an assistant
  turn): the messages rendered with the tokenizer's chat template and its generation prompt, encoded with
  `add_special_tokens=False` (a template writes its own bos); `Prompt.text` is that rendering.
Prompts longer than `max_length` tokens are dropped (their count is logged) or, with `overlong="error"`,
fail the load. Malformed records raise DataError(`path:line: ...`), as does a file with no prompt left.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from aligner.data.jsonl import DataError, json_type, read_jsonl
from aligner.data.sft import adds_bos, check_messages, encode_text, render_chat

log = logging.getLogger(__name__)

OVERLONG = ("drop", "error")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the tokenized prompt (see the module doc)
    text: str  # the text the model sees (a chat prompt's rendering), given to the reward functions
    fields: dict  # every other field of the record ("answer", "tests", ...), given to the reward functions
    source: str  # "path:line", for messages


def tokenize_prompt(prompt, tokenizer) -> tuple[list[int], str]:
    """(ids, text) of a record's `prompt` (see the module doc); raises DataError without the location."""
    if isinstance(prompt, str):
        if not prompt:
            raise DataError("expected a non-empty 'prompt', got an empty string")
        bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
        return bos + encode_text(tokenizer, prompt), prompt
    messages = check_messages(prompt, "prompt", or_string=True)
    if messages[-1]["role"] == "assistant":
        raise DataError("expected the last message of 'prompt' to be a user or system turn (the policy answers "
                        "after it), got an assistant turn")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"chat prompts need a tokenizer with a chat template, and the one at "
                        f"{tokenizer.name_or_path} has none",
                        fix="use a tokenizer with a chat template (tokenizer.path), or plain-text records")
    text = render_chat(tokenizer, messages, generation_prompt=True)
    return encode_text(tokenizer, text), text


def load_prompt_dataset(path: str | Path, tokenizer, max_length: int, overlong: str = "drop") -> list[Prompt]:
    """Read, validate and tokenize a prompt JSONL file (see the module doc)."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    prompts, records, dropped = [], 0, 0
    for line_no, obj in read_jsonl(path):
        records += 1
        where = f"{path}:{line_no}"
        if "prompt" not in obj:
            raise DataError(f"{where}: expected 'prompt' (a string or a list of {{role, content}} messages), but "
                            f"the record has none (keys: {sorted(obj)})")
        if not isinstance(obj["prompt"], (str, list)):
            raise DataError(f"{where}: expected 'prompt' to be a string or a list of {{role, content}} messages, "
                            f"got {json_type(obj['prompt'])}")
        try:
            ids, text = tokenize_prompt(obj["prompt"], tokenizer)
        except DataError as e:
            raise DataError(f"{where}: {e.what}", fix=e.fix) from None
        if len(ids) > max_length:
            if overlong == "error":
                raise DataError(f"{where}: the prompt has {len(ids)} tokens, more than max_length={max_length} "
                                f"(overlong='drop' leaves such prompts out)")
            dropped += 1
            continue
        prompts.append(Prompt(ids, text, {k: v for k, v in obj.items() if k != "prompt"}, where))
    if not prompts:
        why = "it holds no records" if not records else \
            f"all {records} prompts are longer than max_length={max_length} tokens"
        raise DataError(f"{path}: no prompt to train on: {why}")
    (log.warning if dropped else log.info)("%s: %d prompts, %d longer than %d tokens dropped", path, len(prompts),
                                           dropped, max_length)
    return prompts
