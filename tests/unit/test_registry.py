"""aligner/config/registry.py is the one list of algorithms: each name has its YAML, schema, rules and
entry module, and the CLI, the planner, the report and the config loader take their names from it."""
import dataclasses
import importlib
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from aligner import CONF_DIR, cli
from aligner.config.load import compose_config
from aligner.config.registry import ALGORITHMS, COMMAND_CONFIGS, SERVE_CONFIGS, algorithms_of, own_groups
from aligner.config.schema import TrainRunConfig
from aligner.errors import ConfigError, UsageError
from aligner.observe.report_run import Run
from aligner.plan import cli as plan_cli

REQUIRED = ["data.train_path=train.jsonl", "tokenizer.path=tok"]
ATTRIBUTES = ["steerlm.attributes=[helpfulness]"]  # SteerLM's one required key of its own


@pytest.mark.parametrize("name", ALGORITHMS)
def test_each_algorithm_has_its_yaml_built_on_its_schema(name):
    algorithm = ALGORITHMS[name]
    assert dataclasses.is_dataclass(algorithm.schema) and issubclass(algorithm.schema, TrainRunConfig)
    conf = yaml.safe_load((CONF_DIR / f"{algorithm.conf}.yaml").read_text())
    assert f"{algorithm.conf}_schema" in conf["defaults"]
    overrides = REQUIRED + (ATTRIBUTES if name == "steerlm" else [])
    assert OmegaConf.get_type(compose_config(name, overrides)) is algorithm.schema


def test_every_entry_module_has_run_and_main():
    for name, algorithm in ALGORITHMS.items():
        module = importlib.import_module(algorithm.entry)
        assert callable(getattr(module, "run", None)) and callable(getattr(module, "main", None)), name


def test_commands_are_the_algorithms_and_the_servers():
    assert COMMAND_CONFIGS == {**{n: (a.conf, a.schema) for n, a in ALGORITHMS.items()}, **SERVE_CONFIGS}
    with pytest.raises(ConfigError, match="unknown command 'nope'; expected one of " + repr(sorted(COMMAND_CONFIGS))
                       .replace("[", r"\[").replace("]", r"\]")):
        compose_config("nope", [])


def test_the_config_layer_imports_no_algorithm_and_help_no_heavy_package():
    code = ("import sys, aligner.config.registry; "
            "print([m for m in sys.modules if m.startswith(('torch', 'megatron', 'aligner.algorithms'))])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    trace = subprocess.run([sys.executable, "-X", "importtime", "-m", "aligner.cli", "--help"], capture_output=True,
                           text=True, check=True).stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in trace.splitlines() if "|" in line}
    assert imported.isdisjoint({"torch", "megatron", "hydra", "omegaconf", "transformers"})


def test_train_accepts_exactly_the_registry_names(monkeypatch):
    with pytest.raises(UsageError) as refused:
        cli.train("dpoo", [])
    assert refused.value.what == "unknown algorithm 'dpoo'"
    assert refused.value.fix == f"use one of {', '.join(ALGORITHMS)}"

    def composed(command, overrides):
        raise LookupError(command)

    monkeypatch.setattr("aligner.config.load_config", composed)
    for name in ALGORITHMS:  # past the name check, train composes the algorithm's config
        with pytest.raises(LookupError, match=f"^{name}$"):
            cli.train(name, [])


def test_the_cli_help_names_every_algorithm():
    usage = cli.__doc__.split("aligner serve")[0]
    assert all(f" {name}" in usage for name in ALGORITHMS)


def test_plan_accepts_exactly_the_plannable_algorithms():
    assert plan_cli.PLANNABLE == tuple(n for n, a in ALGORITHMS.items() if a.plannable)
    for name in ALGORITHMS:
        if name in plan_cli.PLANNABLE:
            overrides = ["model.vocab_size=512"] + (ATTRIBUTES if name == "steerlm" else [])
            assert set(plan_cli.plan(name, overrides)) >= {"fits", "components", "errors"}
        else:
            with pytest.raises(UsageError, match=f"unknown algorithm '{name}'"):
                plan_cli.plan(name, [])


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_report_tells_each_algorithm_from_its_saved_config(name, tmp_path):
    config = {key: {} for key in own_groups(ALGORITHMS[name].schema) | {"model", "trainer", "run_dir"}}
    if "algorithm" in config:
        config["algorithm"] = {"advantage": "rloo"}  # grpo and reinforce share one schema: the report names this
    expected = "rloo" if name in ("grpo", "reinforce") else name
    assert algorithms_of(config) == (["grpo", "reinforce"] if expected == "rloo" else [name])
    assert Run(tmp_path, "run", [], config, "", []).algorithm() == expected


@pytest.mark.parametrize("groups, names", [
    ({"dpo"}, ["dpo"]), ({"spin"}, ["spin"]), ({"algorithm", "critic"}, ["ppo"]),
    ({"algorithm"}, ["grpo", "reinforce"]), ({"rs", "reward"}, ["rs"]), (set(), ["sft"])])
def test_a_partial_config_is_told_by_the_groups_it_has(groups, names):
    """A config saved before a group existed still names its algorithm."""
    assert algorithms_of({group: {} for group in groups} | {"optim": {}}) == names
