"""The plan of slurm/rl_async.sbatch, asynchronous RL (generation.placement=separate) as one heterogeneous
Slurm job: component 0 trains, component 1 runs the rollout workers. Checked before anything starts.

    python -m aligner.algorithms.online.async_hetjob JOB_ID ALGORITHM [overrides]

reads the job's components (`scontrol show job -o`), composes and validates the run's config as the trainer
will see it (with generation.placement=separate), checks the worker count and layout against component 1's
tasks and the trainer's parallel sizes against component 0's, writes the workers' config
(`<run_dir>/logs/rollout_workers.yaml`), and prints shell assignments for the script: `trainer_args`
(appended to the user's overrides), the trainer's rendezvous, the bridge (address on the trainer's first
host, size, device), the workers' entry point (multi-turn with env.name) and each worker's rendezvous host
and first port (generation/rollout_worker.py
`slurm_worker_env`). Ports come from the job id, so a requeued job gets the same ones. A wrong layout exits 2
with one line naming the component and the key.
"""
from __future__ import annotations

import sys

from aligner.config import compose_config
from aligner.config.validate import validate
from aligner.errors import ConfigError
from aligner.launch.slurm_job import (Component, check_one_task_per_gpu, check_tasks_divide, hostnames,
                                      parse_components, print_plan)

ALGORITHMS = ("grpo", "reinforce")  # PPO's critic service needs a component of its own: slurm/ppo.sbatch


def check_layout(cfg, trainer: Component, workers: Component) -> None:
    """One task per GPU on both sides; component 1 exactly the workers' tasks, each worker's TP ranks on one
    node; the trainer's parallel sizes dividing component 0's tasks."""
    check_one_task_per_gpu("trainer (component 0)", trainer)
    check_one_task_per_gpu("rollout workers (component 1)", workers)
    g = cfg.generation
    need = g.workers * g.tensor_model_parallel_size
    if workers.tasks != need:
        raise ConfigError(f"the rollout workers (component 1) have {workers.tasks} tasks, but generation.workers x "
                          f"generation.tensor_model_parallel_size = {g.workers} x {g.tensor_model_parallel_size} = "
                          f"{need}: give component 1 {need} tasks or set generation.workers to match")
    if workers.tasks % workers.nodes or (workers.tasks // workers.nodes) % g.tensor_model_parallel_size:
        raise ConfigError(f"the rollout workers (component 1) have {workers.tasks} tasks on {workers.nodes} nodes: "
                          f"each node needs a multiple of generation.tensor_model_parallel_size="
                          f"{g.tensor_model_parallel_size} tasks (a worker's TP ranks share a node)")
    m = cfg.model
    check_tasks_divide("trainer", trainer, m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                       * m.context_parallel_size, "model tensor x pipeline x context_parallel_size")


def ports(job_id: int) -> dict[str, int]:
    """Fixed per job (a requeued job gets the same), below Linux's ephemeral range (32768): the trainer's
    rendezvous, the bridge's store, and the first of the workers' rendezvous ports (one per worker)."""
    return {"trainer_master": 26000 + job_id % 1000, "bridge": 27000 + job_id % 1000,
            "workers": 28000 + 256 * (job_id % 16)}


def worker_hosts(workers: Component, tensor_parallel: int, hosts: list[str]) -> list[str]:
    """Each worker's first host: srun places component 1's tasks in blocks, tasks/nodes per node in order."""
    per_node = workers.tasks // workers.nodes
    return [hosts[worker * tensor_parallel // per_node] for worker in range(workers.tasks // tensor_parallel)]


def plan(job_id: int, algorithm: str, overrides: list[str], scontrol_lines: str,
         hosts_of=hostnames) -> dict[str, list[str] | str]:
    # setup imports torch and megatron (seconds): this check runs before the job's ranks start
    from aligner.algorithms.online.setup import save_worker_config, worker_entry, worker_schema

    if algorithm not in ALGORITHMS:
        raise ConfigError(f"slurm/rl_async.sbatch trains {' or '.join(ALGORITHMS)}, got {algorithm!r} as its first "
                          "argument")
    components = parse_components(scontrol_lines)
    if len(components) != 2:
        raise ConfigError(f"slurm/rl_async.sbatch needs a heterogeneous job of 2 components (trainer, rollout "
                          f"workers), job {job_id} has {len(components)}")
    trainer, workers = components
    trainer_args = ["generation.placement=separate"]
    cfg = compose_config(algorithm, [*overrides, *trainer_args])
    check_layout(cfg, trainer, workers)
    validate(cfg, trainer.tasks, algorithm)
    p, trainer_host = ports(job_id), hosts_of(trainer.nodelist)[0]
    config = save_worker_config(cfg)
    gpus = trainer.gpus_per_node and workers.gpus_per_node
    return {"trainer_args": trainer_args, "trainer_master_addr": trainer_host,
            "trainer_master_port": str(p["trainer_master"]), "bridge": f"{trainer_host}:{p['bridge']}",
            "bridge_size": str(1 + workers.tasks), "bridge_device": "cuda" if gpus else "cpu",
            "worker_hosts": ",".join(worker_hosts(workers, cfg.generation.tensor_model_parallel_size,
                                                  hosts_of(workers.nodelist))),
            "worker_port": str(p["workers"]), "worker_config": str(config), "worker_command": worker_schema(cfg),
            "worker_entry": worker_entry(cfg),
            "worker_logs": str(config.parent / "rollout_worker_task_%t.log")}


def main(argv: list[str]) -> int:
    job_id, algorithm, overrides = int(argv[0]), argv[1] if len(argv) > 1 else "", argv[2:]
    return print_plan("slurm/rl_async.sbatch", job_id, lambda lines: plan(job_id, algorithm, overrides, lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
