"""Run a real `aligner train` on CPU ranks and record each rank's memory for tests/test_plan_memory.py.

    python -m tests.plan_memory_worker ALGORITHM OUT_DIR [overrides...]

composes the config as `aligner train` does, then starts its ranks with the embedded launcher; each rank
(`rank`) notes its resident set size just before megatron builds the first GPTModel, runs the
algorithm's own trainer (`aligner.cli.TRAINERS`), and writes {"before": bytes, "peak": VmHWM bytes} to
OUT_DIR/rank_<RANK>.json."""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rank(argv: list[str]) -> None:
    config_path, algorithm, out_dir = argv
    from megatron.core.models.gpt.gpt_model import GPTModel

    from aligner.cli import TRAINERS

    before = {}
    build = GPTModel.__init__

    def noting_build(self, *args, **kwargs):
        before.setdefault("rss", _status_bytes("VmRSS"))
        build(self, *args, **kwargs)

    GPTModel.__init__ = noting_build
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    schedule = OptimizerParamScheduler.__init__

    def noting_setup(self, *args, **kwargs):  # built right after the DDP buffers and the optimizer
        before.setdefault("setup", _status_bytes("VmRSS"))
        schedule(self, *args, **kwargs)

    OptimizerParamScheduler.__init__ = noting_setup
    importlib.import_module(TRAINERS[algorithm]).main([config_path])
    record = {"before": before["rss"], "after_setup": before.get("setup"), "peak": _status_bytes("VmHWM")}
    Path(out_dir, f"rank_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


def main(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from aligner.config import load_config
    from aligner.launch.local import launch

    algorithm, out_dir, overrides = argv[0], argv[1], argv[2:]
    cfg = load_config(algorithm, overrides)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    launch("tests.plan_memory_worker:rank", [str(run_dir / "config.yaml"), algorithm, out_dir],
           cfg.launcher.nproc_per_node, run_dir / "logs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
