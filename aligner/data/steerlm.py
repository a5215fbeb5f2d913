"""SteerLM (Dong et al. 2023, "SteerLM: Attribute Conditioned SFT"; NeMo-Aligner's recipe):
attribute-conditioned SFT, and the same condition at generation time.

The condition of a sample is the text `<attributes>name:value,name:value</attributes>` with the
attributes in one fixed order (the training config's `steerlm.attributes`, saved with every
checkpoint) and integer values in [0, scale] (HelpSteer uses 0..4). It is tokenized on its own and
its ids are placed at the very start of the sequence, after the tokenizer's bos when it adds one,
outside the loss. Training and generation call the same `condition_ids` / `insert_condition`, and
working on ids (not text) means no tokenizer merge across the boundary can make them differ.

Attribute values come from the data (`"attributes": {name: int}` on each SFT record) or from a
regression reward model (`aligner.data.steerlm_labels`). This module imports no other data format, so
SFT's loader (`aligner.data.sft`) can place the condition without importing the reward model's data.
"""
from __future__ import annotations

import json
from typing import Sequence

from aligner.data.jsonl import DataError, json_type


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
