"""JSON Lines reading with `file:line:` error messages.

Conventions: the file is UTF-8; line numbers are 1-based; blank (whitespace-only) lines are skipped;
every other line must hold one JSON object. Errors are `DataError`s whose message starts with
`"{path}:{line_no}: "` (or `"{path}: "` when the file itself cannot be opened).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from aligner.errors import UserError

_JSON_TYPE = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


class DataError(UserError, ValueError):
    """A data file or one of its records is missing or malformed; the message says where and what was expected."""

    fix = "fix that record (or point the data path at the right file)"


@dataclass(frozen=True)
class LoadStats:
    """What loading a data file kept, cut and dropped."""

    records: int  # non-blank lines read
    samples: int  # samples kept
    truncated: int  # kept, but cut to max_length
    dropped: int  # overlong under overlong="drop", or nothing left to train on
    max_length: int

    def __str__(self) -> str:
        return (f"{self.samples} samples, {self.truncated} truncated to {self.max_length} tokens, "
                f"{self.dropped} dropped")


class TokenizedDataset(Sequence):
    """The tokenized samples of one file, with the counts of what was truncated or dropped."""

    def __init__(self, samples: list, stats: LoadStats, path: str | Path | None = None):
        self.samples, self.stats, self.path = samples, stats, path

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def json_type(value) -> str:
    """How JSON names the type of a decoded value, for error messages ("an array", "a string", ...)."""
    return _JSON_TYPE.get(type(value), "an object" if isinstance(value, dict) else type(value).__name__)


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield `(line_no, obj)` for each non-blank line of `path`, where `obj` is a JSON object (a dict)."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{line_no}: expected UTF-8 text") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: expected one JSON object per line, got invalid JSON "
                                f"({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{line_no}: expected a JSON object per line, got {json_type(obj)}")
            yield line_no, obj


def read_token_sequences(path: str | Path, text_key: str, ids_key: str, vocab_size: int,
                         tokenizer_for) -> list[list[int]]:
    """Token ids per line, from `{text_key: str}` or `{ids_key: [int, ...]}` records.

    Text is encoded with the tokenizer that `tokenizer_for(where)` returns (called once, at the first
    text record, so id-only files need no tokenizer; it raises if there is none). Ids must lie in
    [0, vocab_size) and a sequence must not be empty."""
    tokenizer, sequences = None, []
    for line_no, record in read_jsonl(path):
        where = f"{path}:{line_no}"
        if isinstance(record.get(text_key), str):
            tokenizer = tokenizer or tokenizer_for(where)
            ids = list(tokenizer(record[text_key])["input_ids"])
        elif isinstance(record.get(ids_key), list):
            ids = record[ids_key]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise DataError(f"{where}: {ids_key} must be a list of integers")
        else:
            raise DataError(f'{where}: expected {{"{text_key}": str}} or {{"{ids_key}": [int, ...]}}')
        if not ids:
            raise DataError(f"{where}: the sequence is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise DataError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        sequences.append(ids)
    return sequences
