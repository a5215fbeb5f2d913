"""`<run_dir>/metrics.jsonl` (one object per optimizer step), TensorBoard and the experiment trackers
(observe/trackers.py), which get the same steps and keys.

Only global rank 0 writes. On resume, lines for steps after the restored checkpoint are dropped
so the file never holds two versions of a step; a run that starts at step 0 starts the file over."""
from __future__ import annotations

import json
from pathlib import Path

from aligner.observe.trackers import open_trackers

# TensorBoard's writer is imported inside MetricsLog: it imports torch, and aligner.observe stays free
# of torch at import (the CLI process imports aligner.observe.logs before it launches ranks).


class MetricsLog:
    def __init__(self, run_dir, cfg, resume_step: int = 0):
        """`cfg`: the run's config (its `logging` group says what to write; trackers also get all of it)."""
        self.path = Path(run_dir) / "metrics.jsonl"
        logged_through = -1  # the last step a previous attempt logged
        if self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            steps = [json.loads(line)["step"] for line in lines]
            kept = [line for line, step in zip(lines, steps) if step <= resume_step] if resume_step > 0 else []
            self.path.write_text("".join(line + "\n" for line in kept))
            logged_through = max(steps, default=-1)
        self.file = open(self.path, "a")
        self.tb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # torch: see the note above MetricsLog

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)
        self.trackers = open_trackers(run_dir, cfg, resume_step, logged_through)

    def log(self, step: int, metrics: dict) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        for tracker in self.trackers:
            tracker.log(step, values)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        for tracker in self.trackers:
            tracker.close()
