"""Preference data for DPO-family training (pairs) and KTO (unpaired, labelled samples).

Records, one JSON object per line (`aligner.data.jsonl`):
* pairs, text:  `{"prompt": str, "chosen": str, "rejected": str}`.
* pairs, chat:  `{"prompt": [messages], "chosen": str | [messages], "rejected": str | [messages]}`; a
  string is one assistant turn. Without `prompt`, `chosen` and `rejected` may be whole conversations
  (`[messages]`): the prompt is then their longest common leading part that ends before an
  assistant turn.
* reward-aware pairs (`dpo.loss_type=rpo_*`) add `"chosen_reward": number, "rejected_reward": number`.
* unpaired (KTO): `{"prompt": str | [messages], "completion": str | [messages], "label": bool}`
  (true = desirable).

Tokenization. A sequence is the prompt followed by the response; the response tokens are the ones
trained on. Text: `[bos] + enc(prompt + response) + [eos]` (bos only if the tokenizer adds one by
default), and the prompt tokens `[bos] + enc(prompt)` must be a prefix of it. Chat: the conversation
is rendered with the tokenizer's chat template; the prompt rendered with the generation prompt must
be a prefix of it, as text and as tokens (the template ends the assistant turn itself). When the
tokenizer merges characters across the prompt/response boundary (e.g. a prompt ending in "=" and a
response starting with "="), the response tokens cannot be told apart: that record fails with a
DataError naming the tokens, it is never silently re-split. Empty prompts or responses, and pairs whose
chosen and rejected sequences are identical, fail the same way, as `file:line: ...`.

A `Sequence`-level convention shared with SFT (`aligner.data.sft`): `mask[t]` is 1 on the response
tokens, aligned with `ids[t]`; the batch builder shifts it to the label positions.

Overlong sequences (more than `max_length` tokens) are dropped, or truncated to their first
`max_length` tokens when at least one response token is left (a pair whose two truncated sequences
are identical is dropped).

KTO's KL reference point needs mismatched pairs (x_i, y'): sample i's mismatched sequence is its own
prompt followed by the completion tokens of sample (i + 1) mod N of the file, a fixed pairing, so that
reference log-probs can be precomputed per sample.
"""
from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from aligner.data.jsonl import DataError, LoadStats, TokenizedDataset, json_type, read_jsonl
from aligner.data.sft import adds_bos, check_messages, encode_text, render_chat
from aligner.data.synthetic import arithmetic_problems

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferencePair:
    chosen: list[int]  # prompt + chosen response tokens
    rejected: list[int]
    chosen_start: int  # index of the first response token
    rejected_start: int
    chosen_reward: float | None = None  # reward-aware losses (rpo_*)
    rejected_reward: float | None = None
    reference: tuple[float, float] | None = None  # precomputed reference log-prob sums (chosen, rejected)

    def sequences(self) -> list[tuple[list[int], int]]:
        return [(self.chosen, self.chosen_start), (self.rejected, self.rejected_start)]


@dataclass(frozen=True)
class UnpairedSample:
    ids: list[int]  # prompt + completion tokens
    start: int
    desirable: bool
    kl_ids: list[int]  # this prompt + another sample's completion (KTO's KL estimate)
    kl_start: int
    reference: tuple[float, float] | None = None  # precomputed reference log-prob sums (completion, kl)


class PreferenceDataset(TokenizedDataset):
    """The tokenized pairs (or unpaired samples) of one file, which may carry reference log-probs."""

    def with_reference(self, values) -> "PreferenceDataset":
        """A copy whose sample i carries `values[i]` (two floats) as its reference log-probs."""
        samples = [replace(s, reference=(float(v[0]), float(v[1]))) for s, v in zip(self.samples, values)]
        return PreferenceDataset(samples, self.stats, self.path)


# ---- records ---------------------------------------------------------------------------------------
def _response_messages(response, key: str) -> list[dict]:
    if isinstance(response, str):
        if not response:
            raise DataError(f"'{key}' is empty; a response needs at least one character")
        return [{"role": "assistant", "content": response}]
    messages = check_messages(response, key, or_string=True)
    if messages[0]["role"] != "assistant":
        raise DataError(f"'{key}' must start with an assistant message, got role {messages[0]['role']!r}")
    if not any(m["content"] for m in messages):
        raise DataError(f"'{key}' is empty; a response needs at least one character")
    return messages


def _split_conversations(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen tail, rejected tail) for two whole conversations with no explicit prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and not (n < len(chosen) and chosen[n]["role"] == "assistant"):
        n -= 1
    if n == 0:
        raise DataError("without 'prompt', 'chosen' and 'rejected' must be conversations that share their "
                        "leading messages up to an assistant turn, and these share none")
    return chosen[:n], chosen[n:], rejected[n:]



def _check_boundary(tokenizer, prompt_ids: list[int], ids: list[int], key: str) -> int:
    """The prompt must tokenize to a prefix of the whole sequence; returns the response start."""
    if ids[:len(prompt_ids)] != prompt_ids:
        at = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), len(ids))
        raise DataError(
            f"'{key}': the tokenizer merges the end of the prompt with the start of the response, so the response "
            f"tokens cannot be located (alone the prompt ends with tokens {prompt_ids[at:at + 3]} = "
            f"{tokenizer.decode(prompt_ids[at:])!r}, but the whole sequence has {ids[at:at + 3]} = "
            f"{tokenizer.decode(ids[at:at + 3])!r} there); end the prompt with a newline, start the response with the "
            f"separating space instead of ending the prompt with it (byte-level BPEs attach a space to the word "
            f"after it), or use chat records")
    if len(ids) <= len(prompt_ids):
        raise DataError(f"'{key}' adds no tokens after the prompt")
    return len(prompt_ids)


def encode_prompt_response(tokenizer, prompt, response, key: str) -> tuple[list[int], int]:
    """(ids, response start) of one prompt + response (see the module doc)."""
    if isinstance(prompt, str) and isinstance(response, str):
        if not prompt:
            raise DataError("'prompt' is empty; the first response token would have nothing to be predicted from")
        if not response:
            raise DataError(f"'{key}' is empty; a response needs at least one character")
        bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
        prompt_ids = bos + encode_text(tokenizer, prompt)
        ids = bos + encode_text(tokenizer, prompt + response) + [tokenizer.eos_token_id]
        return ids, _check_boundary(tokenizer, prompt_ids, ids, key)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"chat records need a tokenizer with a chat template, and the one at "
                        f"{tokenizer.name_or_path} has none",
                        fix="use a tokenizer with a chat template (tokenizer.path), or plain-text records")
    head = check_messages(prompt, "prompt", or_string=True) if not isinstance(prompt, str) else None
    if head is None:
        raise DataError(f"'{key}' is a message list, so 'prompt' must be one too, got a string")
    tail = _response_messages(response, key)
    prompt_text = render_chat(tokenizer, head, generation_prompt=True)
    text = render_chat(tokenizer, head + tail)
    if not text.startswith(prompt_text):
        raise DataError(f"'{key}': the chat template is not prefix-stable: the prompt rendered with the generation "
                        f"prompt ({prompt_text[-40:]!r} at its end) is not a prefix of the whole conversation")
    ids = encode_text(tokenizer, text)
    return ids, _check_boundary(tokenizer, encode_text(tokenizer, prompt_text), ids, key)


def _sides(obj: dict, fmt: str, keys: tuple[str, ...]):
    """(prompt, responses...) of a record, checked against `fmt` (auto | chat | input_output)."""
    for key in keys:
        if key not in obj:
            raise DataError(f"expected '{key}', but the record has none (keys: {sorted(obj)})")
    responses = [obj[k] for k in keys]
    if "prompt" not in obj:
        if len(keys) == 2 and all(isinstance(r, list) for r in responses):
            prompt, *responses = _split_conversations(*(check_messages(r, k) for r, k in zip(responses, keys)))
        else:
            raise DataError(f"expected 'prompt' (a string or a message list), but the record has none "
                            f"(keys: {sorted(obj)})")
    else:
        prompt = obj["prompt"]
    if not isinstance(prompt, (str, list)):
        raise DataError(f"expected 'prompt' to be a string or a message list, got {json_type(prompt)}")
    for response, key in zip(responses, keys):
        if not isinstance(response, (str, list)):
            raise DataError(f"expected '{key}' to be a string or a message list, got {json_type(response)}")
    chat = isinstance(prompt, list)
    if fmt == "chat" and not chat:
        raise DataError("data.format=chat expects 'prompt' to be a message list, got a string")
    if fmt == "input_output" and (chat or any(isinstance(r, list) for r in responses)):
        raise DataError("data.format=input_output expects strings, got a message list")
    return prompt, responses


def _number(obj: dict, key: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        got = "nothing" if key not in obj else json.dumps(value)
        raise DataError(f"expected '{key}' to be a finite number (reward-aware losses need both 'chosen_reward' and "
                        f"'rejected_reward'), got {got}")
    return float(value)


def tokenize_preference_pair(obj: dict, tokenizer, fmt: str = "auto", rewards: bool = False) -> PreferencePair:
    prompt, (chosen, rejected) = _sides(obj, fmt, ("chosen", "rejected"))
    chosen_ids, chosen_start = encode_prompt_response(tokenizer, prompt, chosen, "chosen")
    rejected_ids, rejected_start = encode_prompt_response(tokenizer, prompt, rejected, "rejected")
    if chosen_ids == rejected_ids:
        raise DataError("'chosen' and 'rejected' are identical after tokenization; a preference pair must differ")
    extra = {"chosen_reward": _number(obj, "chosen_reward"),
             "rejected_reward": _number(obj, "rejected_reward")} if rewards else {}
    return PreferencePair(chosen_ids, rejected_ids, chosen_start, rejected_start, **extra)


def tokenize_unpaired(obj: dict, tokenizer, fmt: str = "auto") -> tuple[list[int], int, bool]:
    prompt, (completion,) = _sides(obj, fmt, ("completion",))
    label = obj.get("label")
    if not isinstance(label, bool):
        raise DataError(f"expected 'label' to be true (desirable) or false (undesirable), got "
                        f"{json.dumps(label) if 'label' in obj else 'nothing'}")
    ids, start = encode_prompt_response(tokenizer, prompt, completion, "completion")
    return ids, start, label


# ---- loading ---------------------------------------------------------------------------------------
def _fit(ids: list[int], start: int, max_length: int, overlong: str) -> list[int] | None:
    """`ids` cut to `max_length` (None: drop it)."""
    if len(ids) <= max_length:
        return ids
    if overlong == "drop" or start >= max_length:
        return None
    return ids[:max_length]


def _check_options(fmt: str, max_length: int, overlong: str) -> None:
    if fmt not in ("auto", "chat", "input_output"):
        raise ValueError(f"fmt must be auto, chat or input_output, got {fmt!r}")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")


def _finish(path, samples, records, truncated, dropped, max_length, overlong) -> PreferenceDataset:
    stats = LoadStats(records, len(samples), truncated, dropped, max_length)
    log.info("%s: %s", path, stats)
    if not samples:
        raise DataError(f"{path}: none of its {records} records gave a usable sample ({dropped} dropped at "
                        f"max_length={max_length}, overlong={overlong!r})")
    return PreferenceDataset(samples, stats, path)


def load_preference_dataset(path: str | Path, tokenizer, fmt: str = "auto", max_length: int = 256,
                            overlong: str = "drop", rewards: bool = False) -> PreferenceDataset:
    """Read, validate and tokenize a JSONL file of preference pairs; `rewards` requires each record's
    `chosen_reward` and `rejected_reward`. Malformed records raise DataError(`path:line: ...`)."""
    _check_options(fmt, max_length, overlong)
    samples, records, truncated, dropped = [], 0, 0, 0
    for line_no, obj in read_jsonl(path):
        records += 1
        try:
            pair = tokenize_preference_pair(obj, tokenizer, fmt, rewards)
        except DataError as e:
            raise DataError(f"{path}:{line_no}: {e.what}", fix=e.fix) from None
        chosen = _fit(pair.chosen, pair.chosen_start, max_length, overlong)
        rejected = _fit(pair.rejected, pair.rejected_start, max_length, overlong)
        if chosen is None or rejected is None or chosen == rejected:
            dropped += 1
            continue
        truncated += (chosen, rejected) != (pair.chosen, pair.rejected)
        samples.append(replace(pair, chosen=chosen, rejected=rejected))
    return _finish(path, samples, records, truncated, dropped, max_length, overlong)


def load_unpaired_dataset(path: str | Path, tokenizer, fmt: str = "auto", max_length: int = 256,
                          overlong: str = "drop") -> PreferenceDataset:
    """Read, validate and tokenize a JSONL file of KTO samples (`prompt`, `completion`, `label`),
    pairing each with the next sample's completion for the KL estimate (see the module doc)."""
    _check_options(fmt, max_length, overlong)
    kept, records, truncated, dropped = [], 0, 0, 0
    for line_no, obj in read_jsonl(path):
        records += 1
        try:
            ids, start, label = tokenize_unpaired(obj, tokenizer, fmt)
        except DataError as e:
            raise DataError(f"{path}:{line_no}: {e.what}", fix=e.fix) from None
        fitted = _fit(ids, start, max_length, overlong)
        if fitted is None:
            dropped += 1
            continue
        truncated += len(fitted) < len(ids)
        kept.append((fitted, start, label))
    samples = []
    for i, (ids, start, label) in enumerate(kept):
        other, other_start, _ = kept[(i + 1) % len(kept)]
        kl_ids = (ids[:start] + other[other_start:])[:max_length]
        samples.append(UnpairedSample(ids, start, label, kl_ids, start))
    return _finish(path, samples, records, truncated, dropped, max_length, overlong)


# ---- a synthetic preference task -------------------------------------------------------------------
def synthetic_preferences(n: int, seed: int, max_operand: int = 9) -> list[dict]:
    """`n` chat pairs "What is a+b?" where the chosen answer is right and the rejected one is off by
    1..5; deterministic by seed. The KTO version of the same task is `synthetic_unpaired`."""
    rng = random.Random(seed * 7 + 3)
    pairs = []
    for p in arithmetic_problems(n, seed, max_operand, ops="+"):
        right = int(p["answer"])
        wrong = right + rng.choice([d for d in (-5, -4, -3, -2, -1, 1, 2, 3, 4, 5) if right + d >= 0])
        prompt = [{"role": "user", "content": f"What is {p['question'][:-1]}?"}]
        pairs.append({"prompt": prompt, "chosen": str(right), "rejected": str(wrong)})
    return pairs


def synthetic_unpaired(n: int, seed: int, max_operand: int = 9) -> list[dict]:
    """KTO records from `synthetic_preferences`: each problem's right answer (desirable) or wrong one."""
    rng = random.Random(seed * 11 + 5)
    records = []
    for pair in synthetic_preferences(n, seed, max_operand):
        good = rng.random() < 0.5
        records.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
    return records


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
