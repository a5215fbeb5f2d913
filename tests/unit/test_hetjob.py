"""The plan of slurm/ppo.sbatch (aligner/algorithms/online/ppo_hetjob.py): the job's components read from `scontrol`,
each side's arguments and job-derived ports, and a layout the job cannot hold refused with the
component and the key. The job itself runs on the local Slurm cluster in tests/e2e/test_ppo.py."""
from __future__ import annotations

import re

import pytest

from aligner.errors import ConfigError
from aligner.algorithms.online import ppo_hetjob as hetjob

# `scontrol show job -o` of a two-component hetjob on Slurm 22.05 (fields trimmed to those read, plus neighbours)
SCONTROL = (
    "JobId=41 HetJobId=41 HetJobIdSet=41-42 HetJobOffset=0 JobName=aligner-ppo JobState=RUNNING NodeList=node1 "
    "NumNodes=1 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=1,billing=2,gres/gpu=2 "
    "TresPerNode=gres:gpu:2\n"
    "JobId=42 HetJobId=41 HetJobIdSet=41-42 HetJobOffset=1 JobName=aligner-ppo JobState=RUNNING NodeList=node[2-3] "
    "NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2,gres/gpu=2 "
    "TresPerNode=gres:gpu:1\n")


def test_the_components_are_read_from_scontrol():
    service, actor = hetjob.parse_components(SCONTROL)
    assert service == hetjob.Component(0, 1, 2, 2, "node1")
    assert actor == hetjob.Component(1, 2, 2, 1, "node[2-3]")
    assert hetjob.parse_components(SCONTROL.replace("TresPerNode=gres:gpu:2", ""))[0].gpus_per_node == 0


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
    assert "service_args=(" in hetjob.shell(p) and "\nactor_master_port=" in hetjob.shell(p)


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
