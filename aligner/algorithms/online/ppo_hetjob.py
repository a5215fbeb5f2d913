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

import sys

from aligner.config import compose_config
from aligner.config.validate import validate
from aligner.errors import ConfigError
from aligner.launch.slurm_job import (Component, check_one_task_per_gpu, check_tasks_divide, hostnames,
                                      parse_components, print_plan)


def check_layout(cfg, service: Component, actor: Component) -> None:
    """One rank per GPU on either side, and each side's parallel sizes dividing its ranks."""
    check_one_task_per_gpu("service (component 0)", service)
    check_one_task_per_gpu("actor (component 1)", actor)
    p, m = cfg.critic.parallel, cfg.model
    check_tasks_divide("service", service, p.tensor_model_parallel_size * p.pipeline_model_parallel_size,
                       "critic.parallel tensor x pipeline_model_parallel_size")
    check_tasks_divide("actor", actor, m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                       * m.context_parallel_size, "model tensor x pipeline x context_parallel_size")


def ports(job_id: int) -> dict[str, int]:
    """Fixed per job (a requeued job gets the same), below Linux's ephemeral range (32768): the service's
    HTTP/gRPC/metrics block and each component's rendezvous port."""
    return {"http": 20000 + 3 * (job_id % 2000), "service_master": 26000 + job_id % 3000,
            "actor_master": 29000 + job_id % 3000}


def plan(job_id: int, overrides: list[str], scontrol_lines: str, host_of=lambda nodes: hostnames(nodes)[0]) -> dict[str, list[str] | str]:
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


def main(argv: list[str]) -> int:
    job_id, overrides = int(argv[0]), argv[1:]
    return print_plan("slurm/ppo.sbatch", job_id, lambda lines: plan(job_id, overrides, lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
