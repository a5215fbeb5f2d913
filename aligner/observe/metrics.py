"""`<run_dir>/metrics.jsonl` (one object per optimizer step) and TensorBoard.

Only global rank 0 writes. On resume, lines for steps after the restored checkpoint are dropped
so the file never holds two versions of a step."""
from __future__ import annotations

import json
from pathlib import Path

# TensorBoard's writer is imported inside MetricsLog: it imports torch, and aligner.observe stays free
# of torch at import (the CLI process imports aligner.observe.logs before it launches ranks).


class MetricsLog:
    def __init__(self, run_dir, tensorboard: bool = True, resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, float(v), step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
