"""What a heterogeneous Slurm job's plan reads and prints (slurm/ppo.sbatch, slurm/rl_async.sbatch): its
components from `scontrol show job -o`, their hosts, and the plan as shell assignments for the script."""
from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass

from aligner.errors import ConfigError


@dataclass(frozen=True)
class Component:
    offset: int
    nodes: int
    tasks: int
    gpus_per_node: int
    nodelist: str


def parse_components(scontrol_lines: str) -> list[Component]:
    """The components of `scontrol show job -o JOB` (one line each, `key=value` fields), by offset."""
    found = []
    for line in scontrol_lines.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "JobId" not in fields:
            continue
        found.append(Component(int(fields.get("HetJobOffset", 0)), int(fields["NumNodes"].split("-")[0]),
                               int(fields["NumTasks"]), _gpus_per_node(fields.get("TresPerNode", "")),
                               fields["NodeList"]))
    return sorted(found, key=lambda c: c.offset)


def _gpus_per_node(tres: str) -> int:
    """8 from 'gres:gpu:8', 'gres/gpu:h100:8' or 'gres/gpu=8'; 0 without GPUs."""
    for item in tres.split(","):
        if "gpu" in item:
            return int(item.replace("=", ":").rsplit(":", 1)[1])
    return 0


def check_one_task_per_gpu(name: str, comp: Component) -> None:
    if comp.gpus_per_node and comp.tasks != comp.nodes * comp.gpus_per_node:
        raise ConfigError(f"the {name} has {comp.tasks} tasks on {comp.nodes} nodes with {comp.gpus_per_node} GPUs "
                          f"each: give it one task per GPU (--ntasks-per-node={comp.gpus_per_node})")


def check_tasks_divide(name: str, comp: Component, size: int, keys: str) -> None:
    """A component's tasks hold whole model-parallel groups of `size` ranks (`keys`: the config keys of that size)."""
    if comp.tasks % size:
        raise ConfigError(f"the {name} (component {comp.offset}) has {comp.tasks} tasks, not a multiple of {keys} = "
                          f"{size}: give component {comp.offset} more tasks or nodes")


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def job_components(job_id: int) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                          check=True).stdout


def shell(assignments: dict[str, list[str] | str]) -> str:
    """`name=value` lines (lists as bash arrays), quoted for the script's `eval`."""
    lines = []
    for name, value in assignments.items():
        if isinstance(value, list):
            lines.append(f"{name}=({' '.join(shlex.quote(v) for v in value)})")
        else:
            lines.append(f"{name}={shlex.quote(value)}")
    return "\n".join(lines)


def print_plan(script: str, job_id: int, plan) -> int:
    """The script's `eval`-able plan on stdout (`plan(scontrol lines)`), or its one-line refusal (exit 2)."""
    try:
        print(shell(plan(job_components(job_id))))
    except ConfigError as e:
        print(f"error: {script}, job {job_id}: {e}", file=sys.stderr)
        return 2
    return 0
