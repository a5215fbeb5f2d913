"""The plan of slurm/ppo.sbatch, PPO as one heterogeneous Slurm job: component 0 runs the critic (+ reward)
service, component 1 the actor. Checked before anything starts.

    python -m aligner.algorithms.online.ppo_hetjob JOB_ID [ppo overrides]

reads the job's components (`scontrol show job -o`), composes and validates the PPO config as the
actor will see it, checks each component's nodes, tasks and GPUs against the parallel sizes, and
prints shell assignments for the script: `service_args` (for `aligner serve critic`), `actor_args`
(appended to the user's overrides), and the rendezvous address and port of each component. Ports
are derived from the job id, so a requeued job gets the same ones. A wrong layout exits 2 with one
line naming the component and the key.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass

from aligner.config import compose_config
from aligner.config.validate import validate
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


def check_layout(cfg, service: Component, actor: Component) -> None:
    """One rank per GPU on either side, and each side's parallel sizes dividing its ranks."""
    for name, comp in (("service (component 0)", service), ("actor (component 1)", actor)):
        if comp.gpus_per_node and comp.tasks != comp.nodes * comp.gpus_per_node:
            raise ConfigError(f"the {name} has {comp.tasks} tasks on {comp.nodes} nodes with {comp.gpus_per_node} GPUs "
                              f"each: give it one task per GPU (--ntasks-per-node={comp.gpus_per_node})")
    p = cfg.critic.parallel
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if service.tasks % mp:
        raise ConfigError(f"the service (component 0) has {service.tasks} tasks, not a multiple of critic.parallel "
                          f"tensor x pipeline_model_parallel_size = {mp}: give component 0 more tasks or nodes")
    m = cfg.model
    mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if actor.tasks % mp:
        raise ConfigError(f"the actor (component 1) has {actor.tasks} tasks, not a multiple of model tensor x "
                          f"pipeline x context_parallel_size = {mp}: give component 1 more tasks or nodes")


def ports(job_id: int) -> dict[str, int]:
    """Fixed per job (a requeued job gets the same), below Linux's ephemeral range (32768): the service's
    HTTP/gRPC/metrics block and each component's rendezvous port."""
    return {"http": 20000 + 3 * (job_id % 2000), "service_master": 26000 + job_id % 3000,
            "actor_master": 29000 + job_id % 3000}


def first_host(nodelist: str) -> str:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def plan(job_id: int, overrides: list[str], scontrol_lines: str, host_of=first_host) -> dict[str, list[str] | str]:
    # ppo imports torch and megatron (seconds); this check runs before the job's ranks start
    from aligner.algorithms.online.ppo import embedded_overrides

    components = parse_components(scontrol_lines)
    if len(components) != 2:
        raise ConfigError(f"slurm/ppo.sbatch needs a heterogeneous job of 2 components (service, actor), job {job_id} "
                          f"has {len(components)}")
    service, actor = components
    p = ports(job_id)
    service_host = host_of(service.nodelist)
    actor_args = [f"critic.url={service_host}:{p['http']}"]
    cfg = compose_config("ppo", [*overrides, *actor_args])
    check_layout(cfg, service, actor)
    validate(cfg, actor.tasks, "ppo")
    service_args = [f"run_dir={cfg.run_dir}/critic", "server.host=0.0.0.0", f"server.port={p['http']}",
                    *[o for o in embedded_overrides(cfg, step=0) if not o.startswith("launcher.nproc_per_node=")],
                    f"launcher.nproc_per_node={service.tasks}"]
    return {"service_args": service_args, "actor_args": actor_args, "service_master_addr": service_host,
            "service_master_port": str(p["service_master"]), "actor_master_addr": host_of(actor.nodelist),
            "actor_master_port": str(p["actor_master"])}


def shell(assignments: dict[str, list[str] | str]) -> str:
    lines = []
    for name, value in assignments.items():
        if isinstance(value, list):
            lines.append(f"{name}=({' '.join(shlex.quote(v) for v in value)})")
        else:
            lines.append(f"{name}={shlex.quote(value)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    job_id, overrides = int(argv[0]), argv[1:]
    lines = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                           check=True).stdout
    try:
        print(shell(plan(job_id, overrides, lines)))
    except ConfigError as e:
        print(f"error: slurm/ppo.sbatch, job {job_id}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
