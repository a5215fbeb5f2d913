"""The plans of slurm/ppo.sbatch (aligner/algorithms/online/ppo_hetjob.py) and slurm/rl_async.sbatch (async_hetjob.py):
the job's components read from `scontrol`, each side's arguments and job-derived ports, and a layout the job
cannot hold refused with the component and the key. The jobs themselves run on the local Slurm cluster in
tests/e2e/test_ppo.py and tests/e2e/test_rl_async.py."""
from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from aligner.errors import ConfigError
from aligner.algorithms.online import async_hetjob, ppo_hetjob as hetjob
from aligner.generation.rollout_worker import slurm_worker_env
from aligner.launch import slurm_job

# `scontrol show job -o` of a two-component hetjob on Slurm 22.05 (fields trimmed to those read, plus neighbours)
SCONTROL = (
    "JobId=41 HetJobId=41 HetJobIdSet=41-42 HetJobOffset=0 JobName=aligner-ppo JobState=RUNNING NodeList=node1 "
    "NumNodes=1 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=1,billing=2,gres/gpu=2 "
    "TresPerNode=gres:gpu:2\n"
    "JobId=42 HetJobId=41 HetJobIdSet=41-42 HetJobOffset=1 JobName=aligner-ppo JobState=RUNNING NodeList=node[2-3] "
    "NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2,gres/gpu=2 "
    "TresPerNode=gres:gpu:1\n")


def test_the_components_are_read_from_scontrol():
    service, actor = slurm_job.parse_components(SCONTROL)
    assert service == slurm_job.Component(0, 1, 2, 2, "node1")
    assert actor == slurm_job.Component(1, 2, 2, 1, "node[2-3]")
    assert slurm_job.parse_components(SCONTROL.replace("TresPerNode=gres:gpu:2", ""))[0].gpus_per_node == 0


def _plan(tiny_assets, *overrides, lines=SCONTROL):
    base = [f"tokenizer.path={tiny_assets / 'tokenizer'}", "reward.functions=[arithmetic]", "run_dir=/runs/x",
            "data.train_path=/data/prompts.jsonl"]
    return hetjob.plan(1234, [*base, *overrides], lines, host_of=lambda nodes: nodes.split("[")[0] + "-host")


def test_the_plan_gives_each_side_its_args_and_job_derived_ports(tiny_assets):
    p = _plan(tiny_assets, "critic.parallel.tensor_model_parallel_size=2", "model.tensor_model_parallel_size=2",
              "critic.checkpoint=/ckpt/sft", "trainer.micro_batch_size=8")
    ports = hetjob.ports(1234)
    assert p["actor_args"] == [f"critic.url=node1-host:{ports['http']}"]
    assert {"run_dir=/runs/x/critic", "server.host=0.0.0.0", f"server.port={ports['http']}", "checkpoint=/ckpt/sft",
            "parallel.tensor_model_parallel_size=2", "launcher.nproc_per_node=2"} <= set(p["service_args"])
    assert (p["service_master_addr"], p["actor_master_addr"]) == ("node1-host", "node-host")
    assert len({ports["http"], ports["http"] + 1, ports["http"] + 2, ports["service_master"],
                ports["actor_master"]}) == 5
    assert max(ports.values()) + 2 < 32768  # below the ephemeral range
    assert ports == hetjob.ports(1234) != hetjob.ports(1235)
    assert "service_args=(" in slurm_job.shell(p) and "\nactor_master_port=" in slurm_job.shell(p)


@pytest.mark.parametrize("overrides, lines, words", [
    (["critic.parallel.tensor_model_parallel_size=4"], SCONTROL, "the service (component 0) has 2 tasks"),
    (["model.tensor_model_parallel_size=4", "critic.parallel.tensor_model_parallel_size=1"], SCONTROL,
     "the actor (component 1) has 2 tasks"),
    ([], SCONTROL.replace("TresPerNode=gres:gpu:1", "TresPerNode=gres:gpu:4"), "one task per GPU"),
    ([], SCONTROL.splitlines()[0], "needs a heterogeneous job of 2 components"),
])
def test_a_layout_the_job_cannot_hold_is_refused(tiny_assets, overrides, lines, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        _plan(tiny_assets, *overrides, lines=lines)


# ------------------------------------------------------------------ slurm/rl_async.sbatch
# trainer: 2 nodes x 2 GPUs; rollout workers: 2 nodes x 4 GPUs (two TP=2 workers on each)
ASYNC = SCONTROL.replace("NodeList=node1 NumNodes=1 NumCPUs=2 NumTasks=2", "NodeList=node[1-2] NumNodes=2 NumCPUs=4 NumTasks=4") \
    .replace("NodeList=node[2-3] NumNodes=2 NumCPUs=2 NumTasks=2", "NodeList=node[3-4] NumNodes=2 NumCPUs=8 NumTasks=8") \
    .replace("TresPerNode=gres:gpu:1", "TresPerNode=gres:gpu:4")


def _async_plan(tiny_assets, tmp_path, *overrides, lines=ASYNC, algorithm="grpo"):
    base = [f"tokenizer.path={tiny_assets / 'tokenizer'}", "reward.functions=[arithmetic]", f"run_dir={tmp_path}",
            "data.train_path=/data/prompts.jsonl", "generation.workers=4", "generation.tensor_model_parallel_size=2"]
    hosts = {"node[1-2]": ["n1", "n2"], "node[3-4]": ["n3", "n4"]}
    return async_hetjob.plan(77, algorithm, [*base, *overrides], lines, hosts_of=hosts.__getitem__)


def test_the_async_plan_places_the_bridge_on_the_trainer_and_each_worker_on_its_node(tiny_assets, tmp_path):
    p = _async_plan(tiny_assets, tmp_path, "model.tensor_model_parallel_size=2", "algorithm.async.max_lag=1")
    ports = async_hetjob.ports(77)
    assert p["trainer_args"] == ["generation.placement=separate"]
    assert (p["trainer_master_addr"], p["trainer_master_port"]) == ("n1", str(ports["trainer_master"]))
    assert (p["bridge"], p["bridge_size"], p["bridge_device"]) == (f"n1:{ports['bridge']}", "9", "cuda")
    assert p["worker_hosts"] == "n3,n3,n4,n4" and p["worker_port"] == str(ports["workers"])
    assert p["worker_command"] == "grpo" and p["worker_logs"] == f"{tmp_path}/logs/rollout_worker_task_%t.log"
    assert p["worker_entry"] == "aligner.generation.rollout_worker:main"
    written = OmegaConf.load(p["worker_config"])  # what the workers load, written before they start
    assert (written.generation.placement, written.generation.workers, written.algorithm["async"].max_lag) == \
        ("separate", 4, 1)
    assert max(ports.values()) + 255 < 32768 and ports == async_hetjob.ports(77 + 16000) != async_hetjob.ports(78)
    episodes = _async_plan(tiny_assets, tmp_path, "env.name=calculator")  # workers that run whole episodes
    assert episodes["worker_entry"] == "aligner.algorithms.online.multiturn:worker_main"
    no_gpus = ASYNC.replace("TresPerNode=gres:gpu:4", "")
    assert _async_plan(tiny_assets, tmp_path, lines=no_gpus)["bridge_device"] == "cpu"


def test_each_srun_task_finds_its_worker_and_bridge_rank():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "ALIGNER_WORKER_HOSTS": "n3,n3,n4,n4",
           "ALIGNER_WORKER_PORT": "28000"}
    assert slurm_worker_env(env, 2) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "n4",
                                        "MASTER_PORT": "28002", "ALIGNER_BRIDGE_RANK": "6"}


@pytest.mark.parametrize("overrides, lines, words", [
    (["generation.workers=3"], ASYNC, "the rollout workers (component 1) have 8 tasks, but generation.workers x "
                                      "generation.tensor_model_parallel_size = 3 x 2 = 6"),
    (["generation.workers=2", "generation.tensor_model_parallel_size=4"],
     ASYNC.replace("NodeList=node[3-4] NumNodes=2 NumCPUs=8 NumTasks=8", "NodeList=node[3-5] NumNodes=3 NumCPUs=8 NumTasks=8"),
     "8 tasks on 3 nodes"),
    (["model.tensor_model_parallel_size=8"], ASYNC, "the trainer (component 0) has 4 tasks"),
    ([], ASYNC.replace("TresPerNode=gres:gpu:2", "TresPerNode=gres:gpu:8"), "give it one task per GPU"),
    ([], ASYNC.splitlines()[0], "needs a heterogeneous job of 2 components"),
])
def test_an_async_layout_the_job_cannot_hold_is_refused(tiny_assets, tmp_path, overrides, lines, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        _async_plan(tiny_assets, tmp_path, *overrides, lines=lines)
    assert not (tmp_path / "logs").exists()  # refused before anything is written


def test_the_async_job_refuses_ppo_in_one_line(tiny_assets, tmp_path):
    with pytest.raises(ConfigError, match="trains grpo or reinforce, got 'ppo'"):
        _async_plan(tiny_assets, tmp_path, algorithm="ppo")
