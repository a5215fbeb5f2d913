"""SteerLM (Dong et al. 2023, "SteerLM: Attribute Conditioned SFT"; NeMo-Aligner's recipe):
attribute-conditioned SFT, and the same condition at generation time.

The condition of a sample is the text `<attributes>name:value,name:value</attributes>` with the
attributes in one fixed order (the training config's `steerlm.attributes`, saved with every
checkpoint) and integer values in [0, scale] (HelpSteer uses 0..4). It is tokenized on its own and
its ids are placed at the very start of the sequence, after the tokenizer's bos when it adds one,
outside the loss. Training and generation call the same `condition_ids` / `insert_condition`, and
working on ids (not text) means no tokenizer merge across the boundary can make them differ.

Attribute values come from the data (`"attributes": {name: int}` on each SFT record) or from a
regression reward model (`write_attribute_labels`): the model's score for each attribute, rounded to the
nearest integer and clipped to [0, scale], as SteerLM's labelling step does.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Sequence

from aligner.data.jsonl import DataError, json_type, read_jsonl


def condition_text(values: dict[str, int], names: Sequence[str]) -> str:
    return "<attributes>" + ",".join(f"{name}:{values[name]}" for name in names) + "</attributes>"


def condition_ids(tokenizer, values: dict[str, int], names: Sequence[str]) -> list[int]:
    return list(tokenizer(condition_text(values, names), add_special_tokens=False)["input_ids"])


def insert_condition(ids: list[int], mask: list[int] | None, condition: list[int], bos_id: int | None):
    """(ids, mask) with `condition` after a leading bos (else at the front), masked out of the loss."""
    at = 1 if ids[:1] == [bos_id] and bos_id is not None else 0
    new_ids = ids[:at] + condition + ids[at:]
    new_mask = None if mask is None else mask[:at] + [0] * len(condition) + mask[at:]
    return new_ids, new_mask


def parse_attributes(obj: dict, names: Sequence[str], scale: int) -> dict[str, int]:
    """The record's `attributes` as {name: int in [0, scale]} for every configured name."""
    raw = obj.get("attributes")
    if not isinstance(raw, dict):
        got = "no 'attributes'" if raw is None else json_type(raw)
        raise DataError(f"expected 'attributes' to be an object {{name: integer}}, got {got}")
    values = {}
    for name in names:
        value = raw.get(name)
        if value is None:
            raise DataError(f"attributes: missing '{name}' (the config's steerlm.attributes are {', '.join(names)})")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= scale:
            raise DataError(f"attributes.{name}: expected an integer in [0, {scale}], got {json.dumps(value)}")
        values[name] = value
    return values


def parse_condition(text: str, names: Sequence[str], scale: int) -> dict[str, int]:
    """`name:value,name:value` (a generation override) -> {name: value}, every trained name given."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition(":")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"steerlm.attributes: '{item}' is not name:integer")
        values[name.strip()] = int(value)
    unknown, missing = set(values) - set(names), [n for n in names if n not in values]
    if unknown or missing:
        raise ValueError(f"steerlm.attributes must give exactly the model's attributes {', '.join(names)}"
                         + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else "")
                         + (f"; missing: {', '.join(missing)}" if missing else ""))
    return parse_attributes({"attributes": values}, names, scale)


def write_attribute_labels(score: Callable[[list[list[int]]], Sequence[Sequence[float]]], names: Sequence[str], tokenizer,
                     data_path, out_path, scale: int = 4, fmt: str = "auto") -> Path:
    """Score every record of an SFT JSONL with a regression reward model and write it back, in order,
    with `attributes` {name: round(clip(score, 0, scale))}. `score(token sequences)` gives one row of
    attribute values (`names`, in order) per sequence; the reward model sees each record as it saw
    its training data (`preference_rm.reward_input_ids`, with its `tokenizer`)."""
    from aligner.data.preference_rm import reward_input_ids  # here: preference_rm -> sft -> steerlm is a cycle

    records, sequences = [], []
    for line_no, obj in read_jsonl(data_path):
        try:
            sequences.append(reward_input_ids(obj, tokenizer, fmt))
        except DataError as e:
            raise DataError(f"{data_path}:{line_no}: {e.what}", fix=e.fix) from None
        records.append(obj)
    scores = score(sequences)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with open(partial, "w") as f:
        for obj, row in zip(records, scores):
            labels = {name: min(scale, max(0, math.floor(value + 0.5))) for name, value in zip(names, row)}
            f.write(json.dumps({**obj, "attributes": labels}) + "\n")
    os.replace(partial, out)
    return out
