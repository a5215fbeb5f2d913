"""`aligner generate` argument handling (the generation itself is tested in test_generation_engine.py)."""
import pytest

from aligner.generation.cli import UsageError, generate_main, parse_overrides, read_prompts


def test_overrides_parse_and_reject_unknown_keys():
    values = parse_overrides(["sampling.greedy=true", "sampling.top_k=5", "batch_size=4",
                              "model.tensor_model_parallel_size=2", "launcher.nproc_per_node=2"])
    assert values["sampling.greedy"] is True and values["sampling.top_k"] == 5 and values["batch_size"] == 4
    assert values["sampling.temperature"] == 1.0  # default
    with pytest.raises(UsageError, match="sampling.tempreature"):
        parse_overrides(["sampling.tempreature=0.5"])
    with pytest.raises(UsageError, match="not a multiple"):
        parse_overrides(["model.tensor_model_parallel_size=2"])
    with pytest.raises(UsageError, match="expected int"):
        parse_overrides(["sampling.top_k=many"])
    assert parse_overrides(["decode=compiled"])["decode"] == "compiled" and parse_overrides([])["decode"] == "auto"
    with pytest.raises(UsageError, match="decode=jit: expected one of auto, lean, compiled, megatron"):
        parse_overrides(["decode=jit"])
    with pytest.raises(UsageError, match="decode=compiled needs model.tensor_model_parallel_size=1"):
        parse_overrides(["decode=compiled", "model.tensor_model_parallel_size=2", "launcher.nproc_per_node=2"])


def test_generate_main_reports_usage_errors(tmp_path):
    """The errors reach the user as one line through aligner.cli (tests/e2e/test_errors.py): here, their kind."""
    from aligner.errors import UsageError, UserError

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    with pytest.raises(UsageError, match="unknown override 'sampling.bogus'"):
        generate_main(["--model", str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                       "sampling.bogus=1"])
    with pytest.raises(UserError, match="does not exist") as missing:
        generate_main(["--model", str(tmp_path / "missing"), "--prompts", str(prompts), "--out", "o"])
    assert missing.value.exit_code == 1 and "--model" in str(missing.value)


def test_read_prompts_reports_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [3, 900]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: token id 900"):
        read_prompts(path, None, vocab_size=500)
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: a text prompt needs"):
        read_prompts(path, None, vocab_size=500)
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [4]}\n')
    assert read_prompts(path, None, vocab_size=500) == [[1, 2], [4]]
