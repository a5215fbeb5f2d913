"""`aligner plan`, the command's contract from outside: JSON keys, exit codes 0/1/2, each impossible layout
refused with its fix, the tiny example; `aligner train`'s pre-launch memory check. The formulas by hand and the
time model against published figures: tests/unit/test_plan_maths.py."""
import json
from types import SimpleNamespace

import pytest

from aligner.plan.cli import compose
from tests.conftest import run_cli


# ---- the command, from outside ----------------------------------------------------------------------------
def plan_in_process(capsys, *args) -> SimpleNamespace:
    """`aligner plan ARGS` as aligner.cli.main runs it (dispatch, a raised error reported as one line with its
    exit code), in this process: the planner imports no torch, so a subprocess would add only its start-up.
    The command in a process of its own: test_tiny_example_plans_on_cpu_and_on_an_h100's table."""
    from aligner import errors
    from aligner.cli import dispatch

    try:
        code = dispatch(["plan", *args])
    except Exception as e:  # noqa: BLE001 - what main() does
        code = errors.handle(e)
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def _plan_json(capsys, *args):
    result = plan_in_process(capsys, *args, "--json")
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def test_tiny_example_plans_on_cpu_and_on_an_h100(capsys):
    result, out = _plan_json(capsys, "sft", "model.vocab_size=512", "cluster.gpu=cpu", "cluster.memory_gib=4")
    assert result.returncode == 0, result.stderr
    assert out["fits"] is True and out["errors"] == [] and isinstance(out["step_time_s"], float)
    actor = out["components"]["actor"]
    assert actor["gpus"] == 1 and 0 < actor["memory_gib_per_gpu"] < 1  # launcher.nproc_per_node ranks
    result, out = _plan_json(capsys, "grpo", "model.vocab_size=512", "cluster.gpus_per_node=1")
    assert result.returncode == 0 and set(out["components"]) == {"actor", "reference", "generation"}
    table = run_cli("plan", "dpo", "model.vocab_size=512", "cluster.gpus_per_node=1")
    assert table.returncode == 0 and "reference" in table.stdout and "step time" in table.stdout


def test_ppo_json_names_every_component(capsys):
    result, out = _plan_json(capsys, "ppo", "model=llama3_70b", "model.tensor_model_parallel_size=8",
                             "model.pipeline_model_parallel_size=4", "critic.parallel.tensor_model_parallel_size=8",
                             "critic.parallel.pipeline_model_parallel_size=4", "cluster.nodes=8",
                             "cluster.service_nodes=4", "optim.distributed_optimizer=true",
                             "critic.optim.distributed_optimizer=true", "critic.trainer.micro_batch_size=1",
                             "trainer.micro_batch_size=1", "data.max_length=1024", "sampling.max_new_tokens=1024",
                             "model.seq_length=2048")
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(out["components"]) == {"actor", "reference", "generation", "critic", "reward"}
    assert out["components"]["actor"]["gpus"] == 64 and out["components"]["critic"]["gpus"] == 32
    assert out["step_time_s"] > 0


def test_memory_over_the_gpu_is_refused_with_the_fix(capsys):
    result, out = _plan_json(capsys, "sft", "model=llama3_70b", "model.tensor_model_parallel_size=8",
                             "model.pipeline_model_parallel_size=1")
    assert result.returncode == 1 and out["fits"] is False
    # one data-parallel rank: sharding the optimizer gains nothing, more pipeline stages or nodes do
    assert "model.pipeline_model_parallel_size" in out["errors"][0] and "GiB" in out["errors"][0]
    assert "distributed_optimizer" not in out["errors"][0]


@pytest.mark.parametrize("overrides,fix", [
    (["model.tensor_model_parallel_size=3"], "set model.tensor_model_parallel_size to one of [1, 2, 4, 8]"),
    (["model.pipeline_model_parallel_size=5"], "set model.pipeline_model_parallel_size to one of [1, 2, 4, 8, 16, 32]"),
    (["cluster.gpus_per_node=6", "model.tensor_model_parallel_size=4"], "GPUs are a multiple of 4"),
    (["trainer.global_batch_size=12", "trainer.micro_batch_size=4"], "set trainer.global_batch_size=16"),
], ids=["tp_heads", "pp_layers", "gpus_tp_pp_cp", "batch"])
def test_impossible_layouts_are_refused_with_their_fix(overrides, fix, capsys):
    result, out = _plan_json(capsys, "sft", "model=llama3_8b", *overrides)
    assert result.returncode == 1 and out["fits"] is False
    assert any(fix in e for e in out["errors"]), out["errors"]


@pytest.mark.parametrize("args", [["sft", "cluster.gpu=tpu"], ["sft", "cluster.bogus=1"], ["sft", "model.bogus=1"],
                                  ["nope"], ["sft", "cluster.gpu=cpu"], ["sft", "--yaml"]])
def test_usage_errors_exit_2(args, capsys):
    result = plan_in_process(capsys, *args, "--json")
    assert result.returncode == 2 and result.stderr.startswith("error:"), result.stderr


# ---- aligner train's pre-launch check on a GPU host ----------------------------------------------------------
def _on_a_gpu_host(monkeypatch, name: str, gib: float) -> None:
    """torch's device query answers as a GPU host's would; everything else (config, planner) is real."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name=name, total_memory=int(gib * 1024 ** 3)))


def test_train_refuses_a_layout_over_the_gpus_memory_before_any_rank_starts(monkeypatch):
    from aligner.cli import _check_memory
    from aligner.errors import UsageError

    _on_a_gpu_host(monkeypatch, "NVIDIA H100 80GB HBM3", 79.6)
    one_gpu = ["model=llama3_8b", "model.tensor_model_parallel_size=1", "model.sequence_parallel=false",
               "launcher.nproc_per_node=1", "trainer.global_batch_size=8", "trainer.micro_batch_size=1"]
    # 8.03e9 parameters on one GPU: bf16 weights 15 GiB + fp32 gradients 30 GiB + Adam 90 GiB
    with pytest.raises(UsageError) as refused:
        _check_memory("sft", compose("sft", one_gpu))
    assert "the trainer's GPUs need" in refused.value.what and "H100" in refused.value.what.upper()
    assert "distributed_optimizer" not in refused.value.what  # one data-parallel rank: nothing to shard over
    fits = ["model=llama3_8b", "model.tensor_model_parallel_size=8", "launcher.nproc_per_node=8",
            "model.seq_length=2048", "optim.distributed_optimizer=true", "trainer.global_batch_size=8",
            "trainer.micro_batch_size=1"]
    _check_memory("sft", compose("sft", fits))  # the same model over 8 GPUs: no error
    _on_a_gpu_host(monkeypatch, "NVIDIA A100-SXM4-40GB", 39.4)  # a device not in the table: its own memory
    with pytest.raises(UsageError) as refused:
        _check_memory("sft", compose("sft", [*fits[:3], "model.seq_length=8192", "trainer.micro_batch_size=8",
                                             "trainer.global_batch_size=8"]))
    assert "the trainer's GPUs need" in refused.value.what and "A100-SXM4-40GB has 36.4 GiB" in refused.value.what
    _on_a_gpu_host(monkeypatch, "NVIDIA H100 80GB HBM3", 79.6)
    with pytest.raises(UsageError) as refused:  # TP 2 x DP 4 without the distributed optimizer
        _check_memory("sft", compose("sft", ["model=llama3_70b", "model.tensor_model_parallel_size=2",
                                             "model.pipeline_model_parallel_size=1", "launcher.nproc_per_node=8",
                                             "trainer.global_batch_size=8", "optim.distributed_optimizer=false"]))
    assert "optim.distributed_optimizer=true" in refused.value.what
