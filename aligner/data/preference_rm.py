"""Reward-model data: preference pairs (Bradley-Terry) and attribute labels (regression).

Records, one JSON object per line (`aligner.data.jsonl`):
* pairs, text:  `{"prompt": str, "chosen": str, "rejected": str, "margin"?: number}`;
  each side is the text `prompt + response`.
* pairs, chat:  `{"prompt": [messages], "chosen": str | [messages], "rejected": ...}` (a string is one
  assistant turn appended to the prompt), or `{"chosen": [messages], "rejected": [messages]}` (whole
  conversations); each side is rendered with the tokenizer's chat template.
* regression:   `{"prompt": str | [messages], "response": str, "labels": {attribute: number | null}}`,
  or `{"messages": [...], "labels": ...}`; without `labels`, the attributes are read from the
  record's top level (HelpSteer files). `labels` may also be a list aligned with the attributes.
  A missing or null label is masked out of the loss.
Tokenization (`encode_for_reward`, shared with the reward server's text input): the text is encoded
without special tokens; the tokenizer's bos is prepended if it adds one by default and the text does
not already start with it; eos is appended unless the text already ends with it. The reward is read
at that last token (`aligner.models.heads.last_token_scores`).
Overlong samples (either side of a pair longer than `max_length`) are dropped by default, or
truncated to their first `max_length` tokens.
`aligner.data.preference` (DPO) reads the same pair records but must find where each response starts,
so it rejects records whose prompt/response boundary merges into one token; a reward model scores
whole sequences, so here each side is one text, tokenized exactly as the reward server does it.
"""
from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aligner.data.jsonl import DataError, LoadStats, TokenizedDataset, json_type, read_jsonl
from aligner.data.sft import adds_bos, check_chat, render_chat
from aligner.data.synthetic import arithmetic_problems, chat_messages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairSample:
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0  # margin-BT: the chosen reward should exceed the rejected one by this much


@dataclass(frozen=True)
class RegressionSample:
    ids: list[int]
    labels: list[float]  # one per attribute; 0.0 where masked
    label_mask: list[float]  # 1.0 where the attribute is labelled


def encode_for_reward(tokenizer, text: str) -> list[int]:
    """Token ids a reward model scores for `text` (see the module doc)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if adds_bos(tokenizer) and ids[:1] != [bos]:
        ids = [bos] + ids
    if ids[-1:] != [tokenizer.eos_token_id]:
        ids.append(tokenizer.eos_token_id)
    return ids


def _side(obj: dict, key: str, fmt: str) -> str | list:
    """The text (input_output) or the conversation (chat) of one side of a record."""
    prompt, response = obj.get("prompt"), obj.get(key)
    if response is None:
        raise DataError(f"expected '{key}', but the record has none (keys: {sorted(obj)})")
    if isinstance(response, list):  # a whole conversation, or the assistant turns after a chat prompt
        if fmt == "input_output":
            raise DataError(f"'{key}' is a message list but data.format=input_output expects strings")
        head = [] if prompt is None else prompt
        if not isinstance(head, list):
            raise DataError(f"'{key}' is a message list, so 'prompt' must be one too, got {json_type(prompt)}")
        return check_chat({"messages": head + response})
    if not isinstance(response, str):
        raise DataError(f"expected '{key}' to be a string or a message list, got {json_type(response)}")
    if isinstance(prompt, list):
        if fmt == "input_output":
            raise DataError("'prompt' is a message list but data.format=input_output expects strings")
        return check_chat({"messages": prompt + [{"role": "assistant", "content": response}]})
    if not isinstance(prompt, str):
        raise DataError(f"expected 'prompt' to be a string or a message list, got {json_type(prompt)}")
    if fmt == "chat":
        raise DataError("data.format=chat expects message lists, got strings")
    return prompt + response


def _encode_side(side, tokenizer) -> list[int]:
    if isinstance(side, str):
        return encode_for_reward(tokenizer, side)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"chat data needs a tokenizer with a chat template, and the one at "
                        f"{tokenizer.name_or_path} has none",
                        fix="use a tokenizer with a chat template (tokenizer.path), or plain-text records")
    return encode_for_reward(tokenizer, render_chat(tokenizer, side))


def tokenize_reward_pair(obj: dict, tokenizer, fmt: str = "auto") -> PairSample:
    margin = obj.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise DataError(f"expected 'margin' to be a finite number, got {json.dumps(margin)}")
    return PairSample(_encode_side(_side(obj, "chosen", fmt), tokenizer),
                      _encode_side(_side(obj, "rejected", fmt), tokenizer), float(margin))


def _labels(obj: dict, attributes: Sequence[str]) -> tuple[list[float], list[float]]:
    raw = obj.get("labels", obj)
    if isinstance(raw, list):
        if len(raw) != len(attributes):
            raise DataError(f"'labels' has {len(raw)} entries but {len(attributes)} attributes are configured "
                            f"({', '.join(attributes)})")
        raw = dict(zip(attributes, raw))
    if not isinstance(raw, dict):
        raise DataError(f"expected 'labels' to be an object or a list, got {json_type(raw)}")
    labels, mask = [], []
    for name in attributes:
        value = raw.get(name)
        if value is None:
            labels.append(0.0)
            mask.append(0.0)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"label '{name}' must be a finite number or null, got {json.dumps(value)}")
        labels.append(float(value))
        mask.append(1.0)
    return labels, mask


def reward_input_ids(obj: dict, tokenizer, fmt: str = "auto") -> list[int]:
    """The ids a regression reward model scores for one record: a whole conversation
    (`messages`), `prompt` + `response`, or an SFT record's `input` + `output`."""
    if "messages" in obj:
        return _encode_side(check_chat(obj), tokenizer)
    if "response" not in obj and "output" in obj:
        obj = {"prompt": obj.get("input"), "response": obj["output"]}
    return _encode_side(_side(obj, "response", fmt), tokenizer)


def tokenize_regression(obj: dict, tokenizer, attributes: Sequence[str], fmt: str = "auto") -> RegressionSample | None:
    """None when the record has no label for any attribute (nothing to learn)."""
    ids = reward_input_ids(obj, tokenizer, fmt)
    labels, mask = _labels(obj, attributes)
    if not any(mask):
        return None
    return RegressionSample(ids, labels, mask)


def load_rm_dataset(path: str | Path, tokenizer, kind: str = "pairs", attributes: Sequence[str] = (),
                    fmt: str = "auto", max_length: int = 256, overlong: str = "drop") -> TokenizedDataset:
    """Read, validate and tokenize a reward-model JSONL file of `kind` "pairs" or "regression";
    malformed records raise DataError(`path:line: ...`)."""
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    samples, records, truncated, dropped = [], 0, 0, 0
    for line_no, obj in read_jsonl(path):
        records += 1
        try:
            sample = (tokenize_reward_pair(obj, tokenizer, fmt) if kind == "pairs"
                      else tokenize_regression(obj, tokenizer, attributes, fmt))
        except DataError as e:
            raise DataError(f"{path}:{line_no}: {e.what}", fix=e.fix) from None
        if sample is None:
            dropped += 1
            continue
        sequences = (sample.chosen, sample.rejected) if kind == "pairs" else (sample.ids,)
        if any(len(s) > max_length for s in sequences):
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
            if kind == "pairs":
                sample = PairSample(sample.chosen[:max_length], sample.rejected[:max_length], sample.margin)
            else:
                sample = RegressionSample(sample.ids[:max_length], sample.labels, sample.label_mask)
        samples.append(sample)
    stats = LoadStats(records, len(samples), truncated, dropped, max_length)
    log.info("%s: %s", path, stats)
    if not samples:
        raise DataError(f"{path}: none of its {records} records gave a usable sample ({dropped} dropped at "
                        f"max_length={max_length}, overlong={overlong!r})")
    return TokenizedDataset(samples, stats)


# ---- a synthetic preference task ---------------------------------------------------------------
def arithmetic_preferences(n: int, seed: int, max_operand: int = 9, ops: str = "+", chat: bool = True,
                           max_miss: int = 10) -> list[dict]:
    """`n` pairs where the chosen response is the right answer to an arithmetic problem and the rejected
    one a near miss, built as swapped twins: two problems whose answers differ by 1..`max_miss` give two
    records, each answer chosen for its own problem and rejected for the other (an answer with no other
    within `max_miss` is paired with the nearest ones). Every answer is then chosen exactly as often as
    it is rejected, so a reward model cannot score some answers higher whatever the question.
    Deterministic by seed."""
    rng = random.Random(seed + 7919)
    pool = arithmetic_problems(4 * n + 64, seed, max_operand, ops)
    by_answer: dict[int, list[dict]] = {}
    for problem in pool:
        by_answer.setdefault(int(problem["answer"]), []).append(problem)

    if len(by_answer) < 2:
        raise ValueError(f"twins need two different answers; max_operand={max_operand}, ops={ops!r} give one")
    near = {}  # answer -> the other answers within max_miss of it (or its nearest ones), ascending
    for right in by_answer:
        gaps = {a: abs(a - right) for a in by_answer if a != right}
        reach = max(max_miss, min(gaps.values()))
        near[right] = sorted(a for a, gap in gaps.items() if gap <= reach)

    def record(problem, chosen, rejected):
        prompt = chat_messages(problem)[:1] if chat else problem["question"]
        return {"prompt": prompt, "chosen": str(chosen), "rejected": str(rejected)}

    records = []
    for problem in pool:
        if len(records) >= n:
            break
        right = int(problem["answer"])
        twin = rng.choice(by_answer[rng.choice(near[right])])
        wrong = int(twin["answer"])
        records += [record(problem, right, wrong), record(twin, wrong, right)]
    return records[:n]


def write_arithmetic_preferences(path: str | Path, n: int, seed: int, **kwargs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_preferences(n, seed, **kwargs)))
    return path
