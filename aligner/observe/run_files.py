"""What `aligner doctor` reads of a run directory: `metrics.jsonl`'s rows, `config.yaml`, the complete and
half-written checkpoints under `checkpoints/`, and the text logs (`logs/rank_*.log` and `*.error`, the PPO
critic's `critic/server.log`, any `*.log` / `*.out` a user redirected there). A run directory that cannot
be read raises `RunDirError`, a `UserError` (aligner.cli prints it as one `error:` line, exit code 1)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from aligner.errors import UserError

LOG_SUFFIXES = (".log", ".out", ".err", ".error")
NOT_LOGS = ("checkpoints", "rollouts", "tensorboard")  # run_dir folders that hold no text logs


class RunDirError(UserError):
    """A run directory doctor cannot read (exit code 1)."""


def checked_run_dir(run_dir) -> Path:
    """`run_dir` as a Path, once it is a directory with a metrics.jsonl."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError("no such run directory", str(run_dir), "pass the run_dir of an `aligner train` run")
    if not (run_dir / "metrics.jsonl").exists():
        raise RunDirError("no metrics.jsonl (no step logged yet, or not a run directory)",
                          str(run_dir / "metrics.jsonl"),
                          "pass the run_dir the run was started with, or wait for its first logged step")
    return run_dir


def read_rows(path: Path) -> list[dict]:
    lines, rows = path.read_text().splitlines(), []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):  # a last line cut short is a process that died mid-write: skip it
                raise RunDirError(f"line {number} is not JSON", f"{path}:{number}", "remove or repair it") from None
    return rows


def read_config(run_dir: Path) -> dict:
    """config.yaml as nested dicts ({} when the run has none)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise RunDirError(f"config.yaml is not valid YAML ({getattr(e, 'problem', None) or type(e).__name__})",
                          f"{path}:{mark.line + 1}" if mark else str(path), "repair the file or remove it") from None
    return config if isinstance(config, dict) else {}


def read_checkpoints(folder: Path) -> tuple[list[int], list[str]]:
    """Steps of the complete checkpoints (checkpoint.py's COMPLETE marker; the step recorded inside
    aligner.json, as `latest_checkpoint` trusts it over the name) and the half-written ones' names."""
    complete, partial = [], []
    for path in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []:
        if path.name.endswith(".partial") or not (path / "COMPLETE").exists():
            partial.append(path.name)
        elif (path / "aligner.json").exists():
            complete.append(json.loads((path / "aligner.json").read_text()).get("trainer_state", {}).get("step", -1))
    return complete, partial


def read_logs(run_dir: Path) -> dict[str, str]:
    """Path relative to `run_dir` -> text, of every text log in it."""
    return {str(p.relative_to(run_dir)): p.read_text(errors="replace") for p in sorted(run_dir.rglob("*"))
            if p.suffix in LOG_SUFFIXES and p.is_file() and p.relative_to(run_dir).parts[0] not in NOT_LOGS}
