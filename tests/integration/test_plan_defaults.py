"""What a user of the big models meets first: `aligner plan <command> model=<GPU model file>` with nothing else
set fits the model file's layout (the file brings its micro-batch and optimizer defaults), and PPO's critic
takes the model's layout unless told otherwise, with any error about it naming `critic.*`."""
import pytest

from aligner.config import load_config
from aligner.errors import ConfigError
from aligner.plan.cli import compose, plan
from tests.conftest import run_cli

GIB = 1024 ** 3
# model file -> the nodes of 8 H100-80GB its stated layout needs for the commands (one replica, or two where the
# file says DP >= 2)
NODES = {"llama3_8b": 1, "llama31_8b": 1, "qwen25_7b": 1, "mistral_7b": 1, "llama3_70b": 4, "llama31_70b": 4,
         "qwen25_72b": 4, "llama31_405b": 28}


def test_dpo_on_the_8b_fits_one_node_with_the_model_files_defaults():
    out = plan("dpo", ["model=llama3_8b", "cluster.nodes=1"])
    assert out["fits"], out["errors"]
    actor, reference = out["components"]["actor"], out["components"]["reference"]
    assert actor["layout"] == "TP2 PP1 CP1 DP4"
    # independent of the planner: 8,030,261,248 parameters (tests/e2e/test_plan.py), halved by TP 2 up to the two
    # replicated norms a layer and the final norm; bf16 weights, fp32 gradients, Adam's 12 bytes over DP 4
    per_gpu = (8_030_261_248 - 65 * 4096) / 2 + 65 * 4096
    assert actor["params_gib"] == pytest.approx(2 * per_gpu / GIB, rel=1e-3)
    assert actor["grads_gib"] == pytest.approx(4 * per_gpu / GIB, rel=1e-3)
    assert actor["optimizer_gib"] == pytest.approx(12 * per_gpu / 4 / GIB, rel=1e-3)
    assert actor["memory_gib_per_gpu"] + reference["memory_gib_per_gpu"] <= out["usable_gib_per_gpu"] < 80
    cfg = compose("dpo", ["model=llama3_8b"])
    assert (cfg.trainer.micro_batch_size, cfg.optim.distributed_optimizer, cfg.model.seq_length) == (1, True, 4096)


def test_the_tiny_model_keeps_each_commands_own_defaults():
    cfg = compose("dpo", [])
    assert (cfg.trainer.micro_batch_size, cfg.optim.distributed_optimizer) == (4, False)
    cfg = compose("dpo", ["model=llama3_8b", "trainer.micro_batch_size=2"])  # the command line still wins
    assert cfg.trainer.micro_batch_size == 2


@pytest.mark.parametrize("model", sorted(NODES))
def test_every_command_fits_a_gpu_model_files_layout_by_default(model):
    # the others plan as one of these: orpo and simpo as rm (pairs, no reference), steerlm as sft, reinforce as grpo
    for algorithm in ("sft", "rm", "dpo", "kto", "grpo", "ppo"):
        overrides = [f"model={model}", f"cluster.nodes={NODES[model]}"]
        if algorithm == "ppo":
            overrides.append(f"cluster.service_nodes={NODES[model]}")
        out = plan(algorithm, overrides)
        assert out["fits"], (model, algorithm, out["errors"])


def test_ppo_on_the_70b_plans_with_the_critic_on_the_models_layout():
    out = plan("ppo", ["model=llama3_70b", "cluster.nodes=8", "cluster.service_nodes=4"])
    assert out["fits"] and out["errors"] == [], out["errors"]
    assert out["components"]["critic"]["layout"] == "TP8 PP4 DP1"  # 32 service GPUs / (TP 8 x PP 4)
    cfg = compose("ppo", ["model=llama3_70b"])
    assert (cfg.critic.parallel.tensor_model_parallel_size, cfg.critic.parallel.pipeline_model_parallel_size) == (
        cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size) == (8, 4)
    cfg = compose("ppo", ["model=llama3_70b", "model.tensor_model_parallel_size=4"])  # follows the override too
    assert cfg.critic.parallel.tensor_model_parallel_size == 4
    cfg = compose("ppo", ["model=llama3_70b", "critic.parallel.tensor_model_parallel_size=2"])
    assert (cfg.critic.parallel.tensor_model_parallel_size, cfg.model.tensor_model_parallel_size) == (2, 8)


def test_a_critic_layout_error_names_the_critic_key():
    base = ["model=llama3_70b", "cluster.nodes=8", "cluster.service_nodes=4"]
    out = plan("ppo", [*base, "critic.parallel.tensor_model_parallel_size=3"])
    assert not out["fits"] and all(e.startswith("critic: ") for e in out["errors"]), out["errors"]
    assert "set critic.parallel.tensor_model_parallel_size to one of [1, 2, 4, 8]" in out["errors"][0]
    out = plan("ppo", [*base, "critic.parallel.pipeline_model_parallel_size=3"])
    assert "critic.parallel.pipeline_model_parallel_size" in out["errors"][0]
    # the critic service runs without sequence parallelism: TP 1 there is no sequence-parallel error
    out = plan("ppo", [*base, "critic.parallel.tensor_model_parallel_size=1",
                       "critic.parallel.pipeline_model_parallel_size=1"])
    assert not any("sequence_parallel" in e for e in out["errors"])
    assert any(e.startswith("the critic service's GPUs need") for e in out["errors"])  # a 70B on one GPU


@pytest.mark.parametrize("overrides, fragment", [
    (["critic.parallel.pipeline_model_parallel_size=3", "critic.launcher.nproc_per_node=3"],
     "critic.parallel.pipeline_model_parallel_size=3 does not divide the model's 4 layers"),
    (["critic.launcher.nproc_per_node=3", "critic.parallel.tensor_model_parallel_size=3"],
     "critic.parallel.tensor_model_parallel_size=3 does not divide the model's 4 attention heads"),
    (["model.tensor_model_parallel_size=2", "launcher.nproc_per_node=2"],
     "critic.launcher.nproc_per_node=1 is not a multiple of critic.parallel"),
])
def test_train_ppo_refuses_a_critic_layout_naming_its_key(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config("ppo", ["tokenizer.path=x", "data.train_path=x", "reward.checkpoint=x", *overrides])


def test_the_planner_command_line_says_it_fits():
    result = run_cli("plan", "dpo", "model=llama3_8b", "cluster.nodes=1", timeout=120)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("fits"), result.stdout + result.stderr


def test_train_checks_a_gpu_hosts_memory_before_any_rank_starts(monkeypatch):
    """`aligner train`'s preflight runs only on a CUDA host, so no CPU run reaches it otherwise: with this host's
    device faked as an H100 80GB, DPO on the 8B fits its model file's layout over one node's 8 GPUs, and the same
    run on one GPU without TP is refused naming what the trainer's GPU needs and what it has."""
    from types import SimpleNamespace

    import torch

    from aligner.errors import UsageError
    from aligner.plan.cli import preflight

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB))
    preflight("dpo", compose("dpo", ["model=llama3_8b"]), 8, 1)
    alone = compose("dpo", ["model=llama3_8b", "model.tensor_model_parallel_size=1",
                            "optim.distributed_optimizer=false"])
    with pytest.raises(UsageError, match=r"the trainer's GPUs need [\d.]+ GiB each .* but a h100-80gb has [\d.]+ GiB"):
        preflight("dpo", alone, 1, 1)


def test_train_checks_what_the_hosts_layer_spec_can_run(monkeypatch):
    """model.transformer_impl=auto resolves on the GPU host: with Transformer Engine there, explicit packing and
    float32 context parallelism are refused before launch (they would fail in the ranks); without it, the memory
    check counts the local spec's attention scores (8B SFT at 8192 tokens: fits on TE's fused attention, not on
    the local attention, which keeps them)."""
    from types import SimpleNamespace

    import torch

    from aligner.errors import UsageError
    from aligner.models import gpt
    from aligner.plan.cli import preflight

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GIB))
    long = ["model=llama3_8b", "model.seq_length=8192", "data.max_length=8192"]
    monkeypatch.setattr(gpt, "use_transformer_engine", lambda impl: impl != "local")  # a host with TE
    preflight("sft", compose("sft", long), 8, 1)
    with pytest.raises(UsageError, match=r"data.packing=true needs the local layer spec.*transformer_impl"):
        preflight("sft", compose("sft", [*long, "data.packing=true"]), 8, 1)
    with pytest.raises(UsageError, match=r"context_parallel_size=2 on Transformer Engine's spec needs bfloat16"):
        preflight("sft", compose("sft", [*long, "model.context_parallel_size=2", "model.params_dtype=float32"]),
                  16, 2)
    monkeypatch.setattr(gpt, "use_transformer_engine", lambda impl: False)  # a host without TE: the local spec
    with pytest.raises(UsageError, match=r"the trainer's GPUs need [\d.]+ GiB each"):
        preflight("sft", compose("sft", long), 8, 1)
