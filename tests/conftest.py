"""Shared fixtures: the tiny tokenizer and synthetic data, built once per test session, and a
helper that runs the `aligner` CLI in a subprocess (each run gets a clean process, like a user's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    from aligner.data.synthetic import corpus, write_sft_chat
    from aligner.data.tokenizer import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    build_tiny_tokenizer(corpus(2000, seed=0), root / "tokenizer", vocab_size=512)
    write_sft_chat(root / "train.jsonl", 400, seed=1)
    write_sft_chat(root / "val.jsonl", 64, seed=2)
    return root


def _cli_env(env: dict | None) -> dict:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)
    return full_env


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aligner.cli", *args], cwd=REPO, env=_cli_env(env),
                          capture_output=True, text=True, timeout=timeout)


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`run_cli` without waiting (stdout and stderr piped, text)."""
    return subprocess.Popen([sys.executable, "-m", "aligner.cli", *args], cwd=REPO, env=_cli_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def write_jsonl_lines(path, lines):
    """Write `lines` to `path`, one per line: strings as they are (malformed lines too), the rest as JSON."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_assets):
    """The tiny example's 512-token BPE tokenizer."""
    from aligner.data.tokenizer import load_tokenizer

    return load_tokenizer(tiny_assets / "tokenizer")
