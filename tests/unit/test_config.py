"""Strict configuration: unknown keys, wrong types, missing values and cross-field conflicts fail
before any process starts, and the message names the key and the fix."""
import pytest
from omegaconf import OmegaConf

from aligner.config import load_config
from aligner.errors import ConfigError

REQUIRED = ["data.train_path=train.jsonl", "tokenizer.path=tok"]


def test_defaults_compose_and_resolve_interpolations():
    cfg = load_config("sft", REQUIRED, world_size=1)
    assert cfg.model.num_layers == 4 and cfg.model.hidden_size == 128  # conf/model/tiny.yaml
    assert cfg.data.max_length == cfg.model.seq_length == cfg.model.max_position_embeddings
    assert cfg.optim.decay_steps == cfg.trainer.max_steps
    assert OmegaConf.is_struct(cfg)


@pytest.mark.parametrize("override, fragment", [
    ("trainer.max_stepz=3", "max_stepz"),
    ("+trainer.max_stepz=3", "max_stepz"),
    ("model.num_layers=four", "model.num_layers"),
    ("model.sequence_parallel=maybe", "model.sequence_parallel"),
])
def test_unknown_keys_and_wrong_types_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config("sft", REQUIRED + [override], world_size=1)


def test_missing_required_value_says_how_to_pass_it():
    with pytest.raises(ConfigError, match=r"data.train_path=\.\.\."):
        load_config("sft", ["tokenizer.path=tok"], world_size=1)


@pytest.mark.parametrize("overrides, world, fragment", [
    (["trainer.global_batch_size=10", "trainer.micro_batch_size=4"], 1, "divisible by trainer.micro_batch_size=4"),
    (["trainer.global_batch_size=12", "trainer.micro_batch_size=4"], 2, "data-parallel size 2"),
    (["model.tensor_model_parallel_size=3"], 3, "num_attention_heads=4 is not divisible"),
    (["model.pipeline_model_parallel_size=3"], 3, "num_layers=4 is not divisible"),
    (["model.context_parallel_size=2", "model.seq_length=250"], 2, "divisible by 2 x context_parallel_size"),
    (["model.tensor_model_parallel_size=2"], 3, "cannot be split"),
    (["model.sequence_parallel=true"], 1, "sequence_parallel=true needs"),
    (["model.num_query_groups=3"], 1, "multiple of model.num_query_groups"),
])
def test_cross_field_rules_explain_the_fix(overrides, world, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config("sft", REQUIRED + overrides, world_size=world)


def test_world_size_follows_nproc_per_node(monkeypatch):
    for var in ("WORLD_SIZE", "SLURM_NTASKS", "SLURM_NNODES"):
        monkeypatch.delenv(var, raising=False)
    load_config("sft", REQUIRED + ["launcher.nproc_per_node=2", "model.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="cannot be split"):
        load_config("sft", REQUIRED + ["launcher.nproc_per_node=3", "model.tensor_model_parallel_size=2"])


def test_unknown_model_group_option_is_reported():
    with pytest.raises(ConfigError, match="model"):
        load_config("sft", REQUIRED + ["model=no_such_model"], world_size=1)


def test_every_model_yaml_matches_the_schema():
    from aligner import CONF_DIR

    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        m = OmegaConf.load(path).model  # one model replica: TP x PP x CP ranks
        ranks = (m.get("tensor_model_parallel_size", 1) * m.get("pipeline_model_parallel_size", 1)
                 * m.get("context_parallel_size", 1))
        cfg = load_config("sft", REQUIRED + [f"model={path.stem}"], world_size=ranks)
        assert cfg.model.num_layers > 0, path


@pytest.mark.parametrize("command, overrides, fragment", [
    ("sft", ["optim.lr=1e-5"], "optim.min_lr=0.0001 is above optim.lr=1e-05"),
    ("steerlm", [], r"steerlm.attributes=\.\.\."),
    ("steerlm", ["steerlm.attributes=[a,a]"], "name each attribute once"),
    ("steerlm", ["steerlm.attributes=[a]", "steerlm.scale=0"], "steerlm.scale must be >= 1"),
])
def test_command_specific_rules_fail_before_launch(command, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(command, REQUIRED + overrides, world_size=1)


@pytest.mark.parametrize("overrides, fragment", [
    (["reference.mode=precompute"], "reference.mode=precompute does not apply to SPIN"),
    (["dpo.loss_type=rpo_sq"], "needs rewards in the data"),
    (["spin.steps_per_iteration=0"], "spin.steps_per_iteration and spin.max_new_tokens must be >= 1"),
    (["model.context_parallel_size=2"], "set model.context_parallel_size=1"),
])
def test_spin_rules_fail_before_launch(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config("spin", REQUIRED + overrides, world_size=2)


@pytest.mark.parametrize("command, overrides, fragment", [
    ("rm", ["rm.loss=regression"], "rm.loss=regression needs rm.attributes"),
    ("rm", ["rm.attributes=[a]"], "only used by rm.loss=regression"),
    ("dpo", ["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"], "applies to dpo.loss_type=sigmoid or robust"),
    ("dpo", ["dpo.label_smoothing=0.5"], r"in \[0, 0.5\)"),
    ("dpo", ["data.packing=true", "model.transformer_impl=transformer_engine"], "needs the local layer spec"),
    ("rm", ["data.packing=true", "model.transformer_impl=transformer_engine"], "needs the local layer spec"),
])
def test_algorithm_rules_fail_before_launch(command, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(command, REQUIRED + overrides, world_size=1)


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_packing_is_automatic_for_dpo_and_rm(command):
    """null: packed on the local layer spec, padded on Transformer Engine's (no error there)."""
    from omegaconf import OmegaConf

    from aligner.algorithms.shared.sequence_trainer import packing_enabled

    local = load_config(command, REQUIRED + ["model.transformer_impl=local"], world_size=1)
    assert local.data.packing is None and packing_enabled(local)
    assert not packing_enabled(load_config(command, REQUIRED + ["data.packing=false"], world_size=1))
    engine = OmegaConf.merge(local, {"model": {"transformer_impl": "transformer_engine"}})
    assert load_config(command, REQUIRED + ["model.transformer_impl=transformer_engine"], world_size=1)
    with pytest.MonkeyPatch.context() as patch:  # a host where Transformer Engine imports
        patch.setattr("aligner.models.gpt.use_transformer_engine", lambda impl: impl != "local")
        assert not packing_enabled(engine)
        with pytest.raises(ValueError, match="data.packing=null packs only where it can"):
            packing_enabled(OmegaConf.merge(engine, {"data": {"packing": True}}))
    assert load_config("sft", REQUIRED, world_size=1).data.packing is False  # opt-in elsewhere


def test_trtllm_refuses_the_refit_check(monkeypatch):
    """TensorRT-LLM's weights cannot be read back, so generation.check_refit is refused before launch (the
    package's presence faked: this host has none)."""
    import importlib.util

    from aligner.config.generation_schema import TRTLLM_NO_REFIT_CHECK, validate_generation_backend
    from aligner.errors import ConfigError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "tensorrt_llm" else None)
    validate_generation_backend("trtllm", check_refit=False)
    with pytest.raises(ConfigError, match="set generation.check_refit=false"):
        validate_generation_backend("trtllm", check_refit=True)
    assert "check_refit" in TRTLLM_NO_REFIT_CHECK


@pytest.mark.parametrize("command, overrides, fragment", [
    ("dpo", ["model.lora.rank=-1"], r"model.lora.rank must be >= 0"),
    ("sft", ["model.lora.rank=8", "model.lora.alpha=0"], r"model.lora.alpha must be > 0"),
    ("grpo", ["model.lora.rank=8", "model.lora.target_modules=[linear_qkv,q_proj]"],
     r"model.lora.target_modules=.*unknown q_proj; valid: linear_qkv, linear_proj, linear_fc1, linear_fc2"),
    ("sft", ["model.lora.rank=8", "model.lora.dropout=1.0"], r"model.lora.dropout must be in \[0, 1\)"),
    ("dpo", ["model.lora.rank=8"], "model.lora.rank=8 adapts a base model: set model.pretrained"),
    ("dpo", ["model.lora.rank=8", "model.pretrained=base", "reference.mode=cpu_swap"],
     "reference.mode=cpu_swap contradicts model.lora.rank=8"),
    ("ppo", ["reward.checkpoint=rm", "critic.lora.rank=4", "critic.lora.target_modules=[mlp]"],
     r"critic.lora.target_modules=\['mlp'\]: unknown mlp"),
])
def test_lora_settings_fail_before_launch_naming_the_key(command, overrides, fragment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "aligner.json").write_text('{"model": {}, "vocab_size": 512}')  # model.pretrained=base: only its metadata is read
    with pytest.raises(ConfigError, match=fragment):
        load_config(command, REQUIRED + overrides, world_size=1)


def test_lora_reference_defaults(tmp_path, monkeypatch):
    """reference.mode is unset by default: the second model without LoRA, the base itself with it;
    precompute stays allowed (computed with the adapters off)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "aligner.json").write_text('{"model": {}, "vocab_size": 512}')
    assert load_config("dpo", REQUIRED, world_size=1).reference.mode is None
    cfg = load_config("dpo", REQUIRED + ["model.lora.rank=8", "model.pretrained=base", "reference.mode=precompute"],
                      world_size=1)
    assert cfg.model.lora.rank == 8 and cfg.model.lora.target_modules == ["linear_qkv", "linear_proj",
                                                                          "linear_fc1", "linear_fc2"]


def test_only_an_srun_step_or_torchrun_makes_a_process_one_rank_of_several():
    """Slurm's batch step (the sbatch script itself: SLURM_PROCID 0 and the job's SLURM_NTASKS, no step id, as
    measured on Slurm 22.05) is one process; an srun step of several tasks and torchrun are ranks of a world."""
    from aligner.launcher_env import outer_world_size
    from aligner.runtime.distributed import process_info_from_env

    batch_step = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_LOCALID": "0",
                  "SLURM_NNODES": "2", "MASTER_ADDR": "node1"}
    assert outer_world_size(batch_step) is None and process_info_from_env(batch_step).world_size == 1
    srun_task = {**batch_step, "SLURM_STEP_ID": "0", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
    assert outer_world_size(srun_task) == 16
    info = process_info_from_env(srun_task)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr) == (9, 16, 1, "node1")
    assert outer_world_size({"WORLD_SIZE": "4", "RANK": "2"}) == 4 and outer_world_size({}) is None


def test_a_rank_gets_its_gpu_and_more_ranks_than_gpus_are_refused():
    """A rank's CUDA device is its local rank's among those it sees (one a task under srun's --gpus-per-task=1);
    a launch of more ranks a node than visible GPUs is refused in one line before NCCL would refuse it."""
    from aligner.errors import UsageError
    from aligner.runtime.distributed import cuda_device

    assert cuda_device(5, {"LOCAL_WORLD_SIZE": "8"}, 8) == 5
    assert cuda_device(5, {"SLURM_LOCALID": "5"}, 1) == 0  # srun bound one GPU to the task
    with pytest.raises(UsageError, match=r"8 ranks on this node but 4 GPU\(s\) visible.*launcher.nproc_per_node"):
        cuda_device(1, {"LOCAL_WORLD_SIZE": "8"}, 4)
