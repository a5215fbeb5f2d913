"""SteerLM's labelling step: attribute values for SFT records from a regression reward model, the model's
score for each attribute rounded to the nearest integer and clipped to [0, scale] (the condition these
values build is `aligner.data.steerlm`'s)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Sequence

from aligner.data.jsonl import DataError, read_jsonl
from aligner.data.preference_rm import reward_input_ids
from aligner.files import atomic_write


def write_attribute_labels(score: Callable[[list[list[int]]], Sequence[Sequence[float]]], names: Sequence[str],
                           tokenizer, data_path, out_path, scale: int = 4, fmt: str = "auto") -> Path:
    """Score every record of an SFT JSONL with a regression reward model and write it back, in order,
    with `attributes` {name: round(clip(score, 0, scale))}. `score(token sequences)` gives one row of
    attribute values (`names`, in order) per sequence; the reward model sees each record as it saw
    its training data (`preference_rm.reward_input_ids`, with its `tokenizer`)."""
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
    with atomic_write(out) as f:
        for obj, row in zip(records, scores):
            labels = {name: min(scale, max(0, math.floor(value + 0.5))) for name, value in zip(names, row)}
            f.write(json.dumps({**obj, "attributes": labels}) + "\n")
    return out
