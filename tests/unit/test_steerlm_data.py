"""SteerLM's condition: its text and place (after BOS, outside the loss), attribute errors naming the key,
a generation condition naming every trained attribute, and the SFT loader conditioning each sample."""
from __future__ import annotations

import pytest

from tests.conftest import write_jsonl_lines

NAMES = ["helpfulness", "verbosity"]


def test_condition_goes_after_bos_and_outside_the_loss(tokenizer):
    from aligner.data.steerlm import condition_ids, condition_text, insert_condition

    values = {"verbosity": 1, "helpfulness": 3}
    assert condition_text(values, NAMES) == "<attributes>helpfulness:3,verbosity:1</attributes>"
    cond = condition_ids(tokenizer, values, NAMES)
    assert tokenizer.decode(cond) == condition_text(values, NAMES)
    assert insert_condition([9, 5, 6], [0, 1, 1], [7, 8], bos_id=9) == ([9, 7, 8, 5, 6], [0, 0, 0, 1, 1])
    assert insert_condition([5, 6], [0, 1], [7, 8], bos_id=9) == ([7, 8, 5, 6], [0, 0, 0, 1])
    assert insert_condition([5, 6], None, [7], bos_id=None) == ([7, 5, 6], None)


@pytest.mark.parametrize("record, fragment", [
    ({}, "expected 'attributes' to be an object"),
    ({"attributes": {"helpfulness": 2}}, "missing 'verbosity'"),
    ({"attributes": {"helpfulness": 2, "verbosity": 5}}, r"attributes.verbosity: expected an integer in \[0, 4\]"),
    ({"attributes": {"helpfulness": 2.5, "verbosity": 1}}, "attributes.helpfulness"),
])
def test_bad_attributes_name_the_key(record, fragment):
    from aligner.data.jsonl import DataError
    from aligner.data.steerlm import parse_attributes

    with pytest.raises(DataError, match=fragment):
        parse_attributes(record, NAMES, 4)


def test_generation_condition_must_name_every_trained_attribute():
    from aligner.data.steerlm import parse_condition

    assert parse_condition("verbosity:1, helpfulness:4", NAMES, 4) == {"helpfulness": 4, "verbosity": 1}
    with pytest.raises(ValueError, match="missing: verbosity"):
        parse_condition("helpfulness:4", NAMES, 4)
    with pytest.raises(ValueError, match="unknown: tone"):
        parse_condition("helpfulness:4,verbosity:1,tone:2", NAMES, 4)
    with pytest.raises(ValueError, match="not name:integer"):
        parse_condition("helpfulness=4,verbosity:1", NAMES, 4)


def test_sft_loader_conditions_each_sample_and_names_file_and_line(tokenizer, tmp_path):
    from aligner.data.jsonl import DataError
    from aligner.data.sft import load_sft_dataset, tokenize_record
    from aligner.data.steerlm import condition_ids, parse_attributes

    records = [{"input": "What is 2+3? ", "output": "5", "attributes": {"helpfulness": 4, "verbosity": 0}},
               {"messages": [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}],
                "attributes": {"helpfulness": 1, "verbosity": 3}}]
    path = write_jsonl_lines(tmp_path / "d.jsonl", records)

    def prefix(record):
        return condition_ids(tokenizer, parse_attributes(record, NAMES, 4), NAMES)

    data = load_sft_dataset(path, tokenizer, prefix=prefix)
    for record, sample in zip(records, data):
        ids, mask = tokenize_record(record, tokenizer)
        cond = prefix(record)
        at = 1 if ids[:1] == [tokenizer.bos_token_id] else 0
        assert sample.ids == ids[:at] + cond + ids[at:]
        assert sample.loss_mask == mask[:at] + [0] * len(cond) + mask[at:]
    write_jsonl_lines(path, [records[0], {"input": "a", "output": "b"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: expected 'attributes'"):
        load_sft_dataset(path, tokenizer, prefix=prefix)
