"""Whether an outer launcher started this process as one rank of several: torchrun (WORLD_SIZE), or a Slurm srun
step of several tasks. A command in an sbatch script itself is not one: the batch step has SLURM_PROCID 0 and the
job's SLURM_NTASKS, but no step id (measured on Slurm 22.05), and it runs as one process or launches its own ranks.
Standard library only: the CLI asks before it imports torch."""
from __future__ import annotations

import os
from typing import Mapping


def in_srun_step(env: Mapping[str, str] = os.environ) -> bool:
    """An srun step of several tasks, each task a rank."""
    return "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


def outer_world_size(env: Mapping[str, str] = os.environ) -> int | None:
    """The ranks an outer launcher started (torchrun's WORLD_SIZE, an srun step's tasks), else None."""
    if "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    return int(env["SLURM_NTASKS"]) if in_srun_step(env) else None
