"""The GPU recipes in examples/ (8B SFT+DPO, 70B PPO hetjob, 405B SFT+DPO), checked on CPU without running them.

For each stage: the recipe's overrides (read with the sbatch script's own grep) plus the README's command line
compose and pass `aligner train`'s checks, in the world size the sbatch script asks Slurm for; the starting
checkpoint is a stand-in with the aligner.json that `aligner convert hf-to-mcore` writes for the real model (its
architecture from the HF config transcribed in tests/unit/test_model_configs.py). PPO goes through the hetjob plan that
slurm/ppo.sbatch runs, with the components read from the recipe's #SBATCH headers, and the service side through
`aligner serve critic`'s checks. Then the first, a middle and the last pipeline stage of each layout are built on the
meta device in a fake process group of the recipe's size (tests/recipe_workers.py) and their parameters counted
against the formula below.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from aligner import cli
from aligner.config import load_config
from aligner.config.schema import ModelConfig
from aligner.models import checkpoint, hf_weights as hw
from tests.conftest import REPO, cli_env, write_jsonl_lines
from tests.unit.test_model_configs import LLAMA3_8B, LLAMA3_70B, LLAMA31_405B

EXAMPLES = REPO / "examples"
# recipe -> (HF config of its model, {stage: (nodes, data-parallel size)})
RECIPES = {"llama3_8b_sft_dpo": (LLAMA3_8B, {"sft": (1, 4), "dpo": (1, 4)}),
           "llama31_405b_sft_dpo": (LLAMA31_405B, {"sft": (28, 2), "dpo": (28, 2)}),
           "llama3_70b_ppo": (LLAMA3_70B, {"ppo": (8, 2)})}


def recipe_overrides(path: Path) -> list[str]:
    """What the sbatch scripts pass: the file's lines that are neither blank nor comments (their own command)."""
    out = subprocess.run(["grep", "-Ev", r"^[[:space:]]*(#|$)", str(path)], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def readme_commands(recipe: str, paths: dict) -> list[list[str]]:
    """The README's `sbatch` command lines, continuation lines joined, $VARs replaced from `paths`, split as the shell would."""
    text = (EXAMPLES / recipe / "README.md").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.startswith("sbatch "):
            line = re.sub(r"\$\{?(\w+)\}?", lambda m: paths[m.group(1)], line)
            commands.append(shlex.split(line))
    return commands


def sbatch_components(script: Path) -> list[dict]:
    """Nodes and tasks per node of each (het) component, from the script's #SBATCH headers."""
    components = [{}]
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH hetjob"):
            components.append({})
        elif m := re.match(r"#SBATCH --(nodes|ntasks-per-node|gpus-per-node)=(\d+)$", line):
            components[-1][m.group(1)] = int(m.group(2))
    return components


def fake_checkpoint(path: Path, hf_config: dict, head: str = "lm") -> Path:
    """A stand-in for `aligner convert hf-to-mcore`'s output: its aligner.json (no weights)."""
    fields = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(ModelConfig), hw.model_fields_from_hf(hf_config)))
    meta = {"format": checkpoint.FORMAT_VERSION, "head": head, "vocab_size": hf_config["vocab_size"],
            "model": {k: v for k, v in fields.items() if k not in checkpoint.PARALLEL_KEYS and k != "pretrained"},
            "saved_with": {k: fields[k] for k in checkpoint.PARALLEL_KEYS}, "trainer_state": {}}
    if head != "lm":
        meta["scalar_head"] = {"num_outputs": 1}
    path.mkdir(parents=True)
    (path / "aligner.json").write_text(json.dumps(meta))
    (path / "COMPLETE").write_text("")
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_assets):
    """$HF, $CKPT, $DATA and $RUNS of the READMEs: the starting checkpoints and data files they name."""
    from aligner.data.synthetic import write_arithmetic_prompts

    root = tmp_path_factory.mktemp("recipes")
    paths = {name: str(root / name.lower()) for name in ("HF", "CKPT", "DATA", "RUNS")}
    hf, ckpt, data, runs = (Path(paths[k]) for k in ("HF", "CKPT", "DATA", "RUNS"))
    for name in ("Meta-Llama-3-8B-Instruct",):  # a tokenizer.path (the tiny one: the test needs a directory)
        (hf / name).mkdir(parents=True)
        for f in (tiny_assets / "tokenizer").iterdir():
            (hf / name / f.name).write_bytes(f.read_bytes())
    fake_checkpoint(ckpt / "llama3-8b", LLAMA3_8B)
    fake_checkpoint(runs / "llama3-8b-sft" / "checkpoints" / "step_001000", LLAMA3_8B)
    fake_checkpoint(ckpt / "llama31-405b", LLAMA31_405B)
    fake_checkpoint(runs / "llama31-405b-sft" / "checkpoints" / "step_000500", LLAMA31_405B)
    fake_checkpoint(ckpt / "llama3-70b-instruct", LLAMA3_70B)
    fake_checkpoint(ckpt / "llama3-70b-rm", {**LLAMA3_70B, "architectures": ["LlamaForSequenceClassification"]},
                    head="reward")
    for tokenizer_dir in (ckpt / "llama31-405b" / "tokenizer", ckpt / "llama3-70b-instruct" / "tokenizer"):
        tokenizer_dir.mkdir()
        for f in (tiny_assets / "tokenizer").iterdir():
            (tokenizer_dir / f.name).write_bytes(f.read_bytes())
    data.mkdir()
    for name in ("sft_train", "sft_val", "prefs_train", "prefs_val"):
        write_jsonl_lines(data / f"{name}.jsonl", ['{"input": "a", "output": "b"}'])
    write_arithmetic_prompts(data / "helpsteer2_prompts_train.jsonl", 8, seed=0, max_operand=9)
    write_arithmetic_prompts(data / "helpsteer2_prompts_val.jsonl", 4, seed=1, max_operand=9)
    return paths


def _world(monkeypatch, tasks: int, nodes: int) -> None:
    """The environment srun gives each rank of the job."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", str(tasks))
    monkeypatch.setenv("SLURM_NNODES", str(nodes))


def _train_checks(stage: str, overrides: list[str]):
    """`aligner train <stage>` up to the launch: compose + validate (load_config), then the CLI's path checks."""
    cfg = load_config(stage, overrides)
    cli._check_paths(cfg)
    if "reward" in cfg:
        cli._check_rl_inputs(cfg)
    return cfg


def _model_file(name: str):
    return OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml").model


@pytest.mark.parametrize("recipe", ["llama3_8b_sft_dpo", "llama31_405b_sft_dpo"])
def test_sft_dpo_recipe_validates(recipe, workspace, monkeypatch):
    hf_config, stages = RECIPES[recipe]
    script = EXAMPLES / recipe / "train.sbatch"
    (component,) = sbatch_components(script)
    commands = readme_commands(recipe, workspace)
    assert [c[2] for c in commands] == list(stages), "the README runs each stage once, in order"
    for command in commands:
        assert command[1] == f"examples/{recipe}/train.sbatch"
        stage, user = command[2], command[3:]
        nodes, dp = stages[stage]
        assert component["nodes"] == nodes and component["ntasks-per-node"] == component["gpus-per-node"] == 8
        _world(monkeypatch, nodes * 8, nodes)
        cfg = _train_checks(stage, recipe_overrides(EXAMPLES / recipe / f"{stage}.overrides") + user)
        m, tp, pp = cfg.model, cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size
        assert nodes * 8 // (tp * pp) == dp
        # the architecture is the checkpoint's, which is the HF model's and the model file's
        assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size) == (
            hf_config["num_hidden_layers"], hf_config["hidden_size"], hf_config["intermediate_size"],
            hf_config["vocab_size"])
        model_file = _model_file(recipe.rsplit("_sft", 1)[0])
        assert (tp, pp, m.sequence_parallel) == (model_file.tensor_model_parallel_size,
                                                 model_file.pipeline_model_parallel_size, True)
        assert m.params_dtype == "bfloat16" and cfg.optim.distributed_optimizer
        assert cfg.trainer.global_batch_size % (cfg.trainer.micro_batch_size * dp) == 0
        if "405b" in recipe:
            assert m.recompute == "full" and (stage != "dpo" or cfg.reference.mode == "precompute")
    # the sbatch script reads the stage's overrides file and hands over to slurm/train.sbatch
    text = script.read_text()
    assert f'examples/{recipe}/$stage.overrides' in text and 'slurm/train.sbatch" "$stage"' in text


def test_ppo_recipe_plans_and_validates(workspace, monkeypatch):
    from aligner.algorithms.online import ppo_hetjob
    from aligner.servers.config import load_serve_config

    recipe = "llama3_70b_ppo"
    script = EXAMPLES / recipe / "ppo.sbatch"
    service, actor = sbatch_components(script)
    assert (service["nodes"], actor["nodes"]) == (4, 8)  # NeMo-Aligner's layout: critic/RM 4 nodes, actor 8
    (command,) = readme_commands(recipe, workspace)
    assert command[1] == f"examples/{recipe}/ppo.sbatch"
    overrides = recipe_overrides(EXAMPLES / recipe / "ppo.overrides") + command[2:]
    # what `scontrol show job -o` says about this job's two components
    lines = "\n".join(f"JobId={100 + i} HetJobOffset={i} NumNodes={c['nodes']} NumTasks={c['nodes'] * c['ntasks-per-node']}"
                      f" TresPerNode=gres/gpu:{c['gpus-per-node']} NodeList=n{i}-[1-{c['nodes']}]"
                      for i, c in enumerate((service, actor)))
    plan = ppo_hetjob.plan(100, overrides, lines, host_of=lambda nodelist: nodelist.split("-")[0] + "-1")
    assert plan["actor_args"][0].startswith("critic.url=n0-1:")
    # the actor's ranks: `aligner train ppo "$@" "${actor_args[@]}"` under srun with 64 tasks
    _world(monkeypatch, 64, 8)
    cfg = _train_checks("ppo", overrides + plan["actor_args"])
    m = cfg.model
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size) == (8, 4)
    dp = actor["nodes"] * actor["ntasks-per-node"] // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size)
    assert dp == RECIPES[recipe][1]["ppo"][1] and cfg.trainer.global_batch_size % (cfg.trainer.micro_batch_size * dp) == 0
    assert cfg.algorithm.prompts_per_step == 1024 and cfg.trainer.global_batch_size == 128  # NeMo-Aligner's runs
    # the service's ranks: `aligner serve critic "${service_args[@]}"` with 32 tasks
    monkeypatch.setenv("SLURM_NTASKS", "32")
    monkeypatch.setenv("SLURM_NNODES", "4")
    serve = load_serve_config("critic", plan["service_args"])
    assert serve.launcher.nproc_per_node == 32
    assert (serve.parallel.tensor_model_parallel_size, serve.parallel.pipeline_model_parallel_size) == (8, 4)
    assert serve.reward_checkpoint == serve.checkpoint == f"{workspace['CKPT']}/llama3-70b-rm"
    assert 'slurm/ppo.sbatch" "${recipe[@]}" "$@"' in script.read_text()


def test_sbatch_scripts_parse():
    scripts = sorted(EXAMPLES.glob("*/*.sbatch")) + sorted((REPO / "slurm").glob("*.sbatch"))
    assert len(scripts) >= 5
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_gpu_only_keys_on_cpu(workspace, monkeypatch):
    """bf16, sequence parallelism and recompute validate on CPU (the recipes above); asking for Transformer
    Engine on a host without it validates too (it is how the model is built, not a layout) and then fails at the
    build with one clear line."""
    from aligner.errors import UserError
    from aligner.models.gpt import layer_spec

    _world(monkeypatch, 8, 1)
    overrides = recipe_overrides(EXAMPLES / "llama3_8b_sft_dpo" / "sft.overrides") + [
        f"model.pretrained={workspace['CKPT']}/llama3-8b", f"tokenizer.path={workspace['HF']}/Meta-Llama-3-8B-Instruct",
        f"data.train_path={workspace['DATA']}/sft_train.jsonl", "model.transformer_impl=transformer_engine"]
    cfg = _train_checks("sft", overrides)
    assert cfg.model.transformer_impl == "transformer_engine" and cfg.model.params_dtype == "bfloat16"
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        with pytest.raises(UserError, match="transformer_engine is needed"):
            layer_spec(cfg.model)


# ---- the models, one pipeline stage at a time, on the meta device ----------------------------------------------
def analytic_params(m, vocab: int, first: bool, last: bool) -> int:
    """Parameters on one GPU of a stage: Llama layers split over TP (norms replicated), the vocabulary padded to a
    multiple of 128 x TP (megatron's rule), the embedding on the first stage, the final norm and untied output
    layer on the last."""
    tp = m.tensor_model_parallel_size
    h, heads, groups, ffn = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    head_dim = h // heads
    qkv_rows = (heads + 2 * groups) * head_dim
    layer = (h * qkv_rows + heads * head_dim * h + h * 2 * ffn + ffn * h) // tp + 2 * h
    if m.add_qkv_bias:
        layer += qkv_rows // tp
    padded = -(-vocab // (128 * tp)) * 128 * tp
    total = m.num_layers // m.pipeline_model_parallel_size * layer
    return total + (padded // tp * h if first else 0) + (h + padded // tp * h if last else 0)


def test_each_stage_builds_on_meta_with_the_analytic_parameter_count(workspace, monkeypatch, tmp_path):
    entries, expected = [], []
    stages = [(recipe, stage) for recipe, (_, by_stage) in RECIPES.items() for stage in by_stage]
    for recipe, stage in stages:
        nodes = RECIPES[recipe][1][stage][0]
        command = next(c for c in readme_commands(recipe, workspace) if stage in (c[2], "ppo"))
        user = command[3:] if stage != "ppo" else command[2:] + ["critic.url=localhost:5567"]
        _world(monkeypatch, nodes * 8, nodes)
        cfg = _train_checks(stage, recipe_overrides(EXAMPLES / recipe / f"{stage}.overrides") + user)
        m = cfg.model
        tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        world = nodes * 8
        # ranks are TP-fastest then DP then PP (megatron's default order): the first rank of the first, a middle
        # and the last stage
        for pp_rank in sorted({0, pp // 2, pp - 1}):
            entries.append({"model": OmegaConf.to_container(m), "vocab_size": m.vocab_size, "world_size": world,
                            "rank": pp_rank * world // pp})
            expected.append((recipe, stage, pp_rank, analytic_params(m, m.vocab_size, pp_rank == 0, pp_rank == pp - 1),
                             world // (tp * pp), tp, m.recompute))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(entries))
    result = subprocess.run([sys.executable, "-m", "tests.recipe_workers", "meta", str(spec)], cwd=REPO,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    built = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(built) == len(expected)
    for got, (recipe, stage, pp_rank, params, dp, tp, recompute) in zip(built, expected):
        where = f"{recipe} {stage} stage {pp_rank}"
        assert got["devices"] == ["meta"], where
        assert (got["pp_rank"], got["dp"], got["tp"]) == (pp_rank, dp, tp), where
        assert got["params"] == params, f"{where}: built {got['params']}, formula {params}"
        assert got["recompute"] == (None if recompute == "none" else recompute), where
    # the 405B's first stage, by hand: 9 layers of 398.5 M a GPU (norms included) + the 129024-row embedding / 8
    first_405b = next(g for g, e in zip(built, expected) if e[:3] == ("llama31_405b_sft_dpo", "sft", 0))
    assert first_405b["params"] == 9 * 398_491_648 + 129024 // 8 * 16384 == 3_850_665_984


def test_recompute_keeps_gradients_and_recomputes():
    result = subprocess.run([sys.executable, "-m", "tests.recipe_workers", "recompute"], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(result.stdout.strip().splitlines()[-1])
    assert r["none"]["attention_calls"] == 4  # the tiny model's 4 layers, once each
    for mode in ("selective", "full"):
        assert r[mode]["config"] == mode
        assert r[mode]["attention_calls"] == 8  # and again in the backward pass
        assert r[mode]["loss"] == r["none"]["loss"] and r[mode]["max_grad_diff"] <= 1e-6
