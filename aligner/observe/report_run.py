"""A run directory as `aligner report` sees it (`Run`), and the report's error: what report.py reads
and report_html.py renders, below both so that neither imports the other's caller."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from aligner.config.registry import algorithms_of
from aligner.errors import UserError


class ReportError(UserError):
    """A run directory the report cannot read, or a file it cannot write (exit code 1)."""

    def __init__(self, what: str, where: Path | str, fix: str):
        super().__init__(what, str(where), fix)


@dataclass
class Run:
    path: Path
    label: str  # its name in legends: the shortest tail of its path that no other run shares
    rows: list[dict]  # metrics.jsonl, one dict per logged step
    config: dict  # config.yaml as nested dicts ({} when the run has none)
    config_text: str
    rollouts: list[tuple[int, list[dict]]]  # (step, rows) of the latest rollout files, oldest first

    def metric_names(self) -> list[str]:
        names = {}
        for row in self.rows:
            names.update(dict.fromkeys(k for k in row if k != "step"))
        return list(names)

    def series(self, name: str) -> tuple[list[float], list[float]]:
        """(steps, values) of one metric, non-finite values left out."""
        points = [(row["step"], row[name]) for row in self.rows
                  if isinstance(row.get(name), (int, float)) and math.isfinite(row[name])]
        return [p[0] for p in points], [p[1] for p in points]

    def last_step(self) -> int:
        return max((row["step"] for row in self.rows), default=0)

    def algorithm(self) -> str:
        """The algorithm whose config the run saved; grpo's and reinforce's are one schema: their advantage."""
        if not self.config:
            return "unknown (no config.yaml)"
        names = algorithms_of(self.config)
        if len(names) == 1:
            return names[0]
        return str(self.config.get("algorithm", {}).get("advantage") or " or ".join(names))

    def latest_checkpoint(self) -> str:
        found = sorted((self.path / "checkpoints").glob("step_*"))
        return found[-1].name if found else "none"
