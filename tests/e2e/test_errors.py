"""Every mistake a user can make ends with one `error: <what>, <where>, <how to fix>` line on stderr,
exit code 2 (usage, config) or 1 (the rest), no traceback, and the traceback in a log file; a bug
keeps its traceback. Each case runs through the CLI in a subprocess, as a user would run it."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REWARDS, run_cli


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple  # CLI arguments; "{name}" is formatted from the paths fixture
    code: int  # expected exit code
    says: tuple  # substrings the error line must hold: the what and the where
    env: dict = field(default_factory=dict)


def sft(*more):
    return ("train", "sft", "run_dir={out}/run", "tokenizer.path={tokenizer}", "data.train_path={train}",
            "trainer.max_steps=2", "logging.progress=false", "logging.tensorboard=false", *more)


def grpo(*more):
    return ("train", "grpo", "run_dir={out}/run", "tokenizer.path={tokenizer}", "model.pretrained={sft_ckpt}",
            "data.train_path={prompts}", f"reward.functions=[{REWARDS}:emits_target]", "trainer.max_steps=1",
            "algorithm.prompts_per_step=2", "algorithm.num_generations=2", "trainer.global_batch_size=4",
            "trainer.micro_batch_size=4", "sampling.max_new_tokens=2", "logging.progress=false",
            "logging.tensorboard=false", *more)


# a "how to fix" is an instruction: one of these verbs (after the what and the where)
FIX = re.compile(r"[,;:] .*\b(set|pass|use|install|fix|pick|start|check|train|import|round|choose|see|drop|run|point|"
                 r"write|give|name|free|stop|lower|raise|add|remove|convert|correct)\b", re.IGNORECASE)
TWO_RANKS = "launcher.nproc_per_node=2"
CASES = [
    # data
    Case("malformed JSON line", sft("data.train_path={bad_json}"), 1, ("bad_json.jsonl:13", "invalid JSON")),
    Case("malformed JSON line, two ranks", sft("data.train_path={bad_json}", TWO_RANKS), 1, ("bad_json.jsonl:13",)),
    Case("record without its fields", sft("data.train_path={no_fields}"), 1, ("no_fields.jsonl:2",)),
    Case("empty data file", sft("data.train_path={empty}"), 1, ("empty.jsonl",)),
    Case("preference record without 'rejected'",
         ("train", "dpo", "run_dir={out}/run", "tokenizer.path={tokenizer}", "data.train_path={no_rejected}",
          "trainer.max_steps=1", "logging.progress=false"), 1, ("no_rejected.jsonl:1", "rejected")),
    Case("chat data, tokenizer without a chat template", sft("tokenizer.path={no_template}"), 1,
         ("chat template", "no_template")),
    Case("bad prompt record", grpo("data.train_path={bad_prompt}"), 1, ("bad_prompt.jsonl:3", "'prompt'")),
    Case("model vocabulary smaller than the tokenizer's", sft("model.vocab_size=64"), 2, ("model.vocab_size",)),
    # config
    Case("unknown key", sft("trainer.max_stepz=3"), 2, ("trainer.max_stepz",)),
    Case("wrong type", sft("trainer.max_steps=many"), 2, ("trainer.max_steps", "many")),
    Case("heads not divisible by TP", sft("launcher.nproc_per_node=3", "model.tensor_model_parallel_size=3"), 2,
         ("model.num_attention_heads", "tensor_model_parallel_size=3")),
    Case("batch not divisible", sft("trainer.global_batch_size=7", "trainer.micro_batch_size=2"), 2,
         ("global_batch_size",)),
    Case("override without a value", sft("trainer.max_steps"), 2, ("trainer.max_steps",)),
    Case("unknown algorithm", ("train", "dpoo"), 2, ("dpoo", "aligner train")),
    Case("unknown command", ("trian", "sft"), 2, ("trian",)),
    Case("missing argument", ("convert", "hf-to-mcore", "--out", "{out}/x"), 2, ("--hf", "aligner convert")),
    Case("unknown reward function", grpo("reward.functions=[no_such_reward]"), 2, ("no_such_reward",)),
    Case("context parallelism with megatron's decode", grpo(TWO_RANKS, "model.context_parallel_size=2",
                                                             "generation.decode=megatron"), 2,
         ("context_parallel_size", "generation.decode=megatron")),
    # files
    Case("missing checkpoint", sft("model.pretrained={out}/nope"), 1, ("model.pretrained", "nope")),
    Case("directory that is no checkpoint", sft("model.pretrained={not_ckpt}"), 1, ("not_ckpt", "checkpoint")),
    Case("missing tokenizer", sft("tokenizer.path={out}/no_tokenizer"), 1, ("tokenizer.path",)),
    Case("tokenizer directory without a tokenizer", sft("tokenizer.path={not_ckpt}"), 1, ("not_ckpt", "tokenizer")),
    Case("missing prompts", grpo("data.train_path={out}/no_prompts.jsonl"), 1, ("data.train_path",)),
    Case("generate from a missing model",
         ("generate", "--model", "{out}/nope", "--prompts", "{prompts}", "--out", "{out}/g.jsonl"), 1, ("--model",)),
    Case("convert a missing HF directory", ("convert", "hf-to-mcore", "--hf", "{out}/nope", "--out", "{out}/x"), 1,
         ("nope", "Hugging Face")),
    # services
    Case("unreachable critic", ("train", "ppo", "run_dir={out}/run", "tokenizer.path={tokenizer}",
                                "model.pretrained={sft_ckpt}", "reward.checkpoint={sft_ckpt}",
                                "data.train_path={prompts}", "critic.url=127.0.0.1:{dead_port}",
                                "critic.startup_timeout_s=2", "trainer.max_steps=1", "logging.progress=false"), 1,
         ("127.0.0.1:{dead_port}",)),
    Case("unreachable reward server", grpo("reward.functions=[]", "reward.url=127.0.0.1:{dead_port}",
                                            "reward.timeout_s=2"), 1,
         ("127.0.0.1:{dead_port}",)),
    Case("busy port", ("serve", "verifier", "run_dir={out}/serve", "server.port={busy_port}"), 1,
         ("port {busy_port}",)),
    # environment
    Case("no C++ compiler for compiled decode",
         ("generate", "--model", "{sft_ckpt}", "--prompts", "{text_prompts}", "--out", "{out}/g.jsonl",
          "decode=compiled"),
         1, ("C++ compiler", "decode"), env={"PATH": os.path.dirname(sys.executable)}),
    Case("missing optional GPU package", sft("model.transformer_impl=transformer_engine"), 1,
         ("transformer_engine", "pip install")),
    Case("missing optional GPU package, two ranks", sft("model.transformer_impl=transformer_engine", TWO_RANKS), 1,
         ("transformer_engine", "pip install")),
    # never faked: these hosts have no TensorRT-LLM (it is not on PyPI), so the config check refuses before any rank
    Case("TensorRT-LLM backend without TensorRT-LLM", grpo("generation.backend=trtllm"), 2,
         ("generation.backend=trtllm", "tensorrt_llm", "Dockerfile")),
    Case("TensorRT-LLM backend without TensorRT-LLM, generate",
         ("generate", "--model", "{sft_ckpt}", "--prompts", "{prompts}", "--out", "{out}/g.jsonl",
          "generation.backend=trtllm"), 2, ("generation.backend=trtllm", "tensorrt_llm", "Dockerfile")),
]


@pytest.fixture(scope="module")
def paths(tiny_assets, rl_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("mistakes")
    lines = (tiny_assets / "train.jsonl").read_text().splitlines()

    def write(name: str, text: str) -> str:
        (root / name).write_text(text)
        return str(root / name)

    no_template = root / "no_template"
    shutil.copytree(tiny_assets / "tokenizer", no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    (root / "not_ckpt").mkdir()
    prompts = (rl_assets / "target.jsonl").read_text().splitlines()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    yield {
        "out": str(root), "tokenizer": str(tiny_assets / "tokenizer"), "train": str(tiny_assets / "train.jsonl"),
        "sft_ckpt": str(rl_assets / "sft" / "checkpoints" / "step_000040"), "prompts": str(rl_assets / "target.jsonl"),
        "bad_json": write("bad_json.jsonl", "\n".join(lines[:12] + ['{"messages": [oops'] + lines[13:]) + "\n"),
        "no_fields": write("no_fields.jsonl", lines[0] + '\n{"text_that_is_not_a_field": 1}\n'),
        "empty": write("empty.jsonl", ""),
        "no_rejected": write("no_rejected.jsonl", '{"prompt": "1+1=", "chosen": "2"}\n'),
        "bad_prompt": write("bad_prompt.jsonl", "\n".join(prompts[:2] + ['{"prompt": 5}']) + "\n"),
        "text_prompts": write("text_prompts.jsonl", '{"prompt": "What is 1+2?"}\n'),
        "no_template": str(no_template), "not_ckpt": str(root / "not_ckpt"),
        "busy_port": busy.getsockname()[1], "dead_port": dead.getsockname()[1],
    }
    busy.close()
    dead.close()


def _format(value, paths):
    return value.format(**paths) if isinstance(value, str) else value


def assert_one_error_line(result, case: Case, paths) -> str:
    stderr = result.stderr
    assert result.returncode == case.code, f"{case.name}: exit {result.returncode}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, f"{case.name}: a traceback reached the terminal\n{stderr[-3000:]}"
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, f"{case.name}: expected one error line, got {len(lines)}\n{stderr[-3000:]}"
    line = lines[0]
    for text in case.says:
        assert _format(text, paths) in line, f"{case.name}: {_format(text, paths)!r} not in {line!r}"
    assert FIX.search(line), f"{case.name}: the line says no way to fix it: {line!r}"
    match = re.search(r"\(traceback: (\S+)\)$", line)
    assert match and Path(match.group(1)).is_file(), f"{case.name}: no traceback file named in {line!r}"
    assert "Traceback" in Path(match.group(1)).read_text()
    return line


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_mistake_ends_with_one_error_line(case, paths):
    args = [_format(a, paths) for a in case.args]
    result = run_cli(*args, env=case.env, timeout=300)
    assert_one_error_line(result, case, paths)


def test_the_cases_are_distinct_and_cover_every_kind_of_mistake():
    assert len({c.name for c in CASES}) == len(CASES) >= 25
    assert any(TWO_RANKS in c.args for c in CASES)


def test_aligner_debug_shows_the_traceback_too(paths):
    case = CASES[0]
    result = run_cli(*[_format(a, paths) for a in case.args], env={"ALIGNER_DEBUG": "1"})
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "error: " in result.stderr


def test_a_traceback_in_the_run_logs_when_a_rank_fails(paths):
    run_dir = Path(paths["out"]) / "ranks"
    args = [_format(a, paths).replace("{out}/run".format(**paths), str(run_dir)) for a in CASES[1].args]
    result = run_cli(*args)
    line = [x for x in result.stderr.splitlines() if x.startswith("error: ")][0]
    assert str(run_dir / "logs") in line


def test_a_bug_keeps_its_traceback():
    """A programming error is not the user's: its traceback is shown (a command replaced by one that divides by 0)."""
    code = ("import sys, aligner.cli as cli; cli.HANDLERS['convert'] = lambda argv: 1 / 0; "
            "sys.exit(cli.main(['convert']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ZeroDivisionError" in result.stderr
    assert "error: " not in result.stderr
