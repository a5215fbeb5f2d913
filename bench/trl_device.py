"""Run one of the TRL peer baseline's scripts on this host's accelerator.

    cd $ALIGNER_TRL_BENCH_DIR && python /path/to/bench/trl_device.py bench_grpo.py [args]

The baseline's scripts (../shared/reference/bench-trl) pin TRL to the CPU in fp32 (common.common_args:
use_cpu=True, bf16=False). On a host with CUDA this runs the script with those two fields changed:
use_cpu=False, and bf16 (mixed precision: autocast over fp32 weights) when TRL_BENCH_BF16=1. Everything
else, the timing instrumentation included, is the script's own. Without CUDA the script runs unchanged.
bench/accept.py's trl check points bench/rl_vs_trl.py at this (ALIGNER_TRL_PYTHON) to drive TRL there.
"""
from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: trl_device.py SCRIPT [args] (in the peer baseline's folder)")
    sys.path.insert(0, os.getcwd())
    import common  # the baseline's common.py; its scripts import common_args from it by name
    import torch

    if torch.cuda.is_available():
        cpu_args = common.common_args

        def device_args() -> dict:
            return {**cpu_args(), "use_cpu": False, "bf16": os.environ.get("TRL_BENCH_BF16") == "1"}

        common.common_args = device_args
    if os.environ.get("TRL_BENCH_MAX_NEW_TOKENS"):
        common.RUN["rl_max_new_tokens"] = int(os.environ["TRL_BENCH_MAX_NEW_TOKENS"])
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
