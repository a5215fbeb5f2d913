"""DPO (padded and packed) and KTO under TP=2, PP=2 (1F1B), CP=2 and DP=2 against one process, on the
first two optimizer steps through `SequenceTrainer`; and, in one process, the three reference modes
against each other and packed against padded batches.

Two launches in all: tests/preference_workers.py runs the single-process reference, then every layout
in turn inside one 2-rank launch. Tolerances (fp32, CPU): metrics 1e-5, gradients 1e-5, parameters
after two Adam steps (lr 1e-3) 1e-4.
"""
import json
import math

import pytest

from aligner.launch.local import launch

LAYOUTS = {
    "tp2": ({"model.tensor_model_parallel_size": 2}, ["dpo", "dpo_packed", "kto"]),
    "pp2": ({"model.pipeline_model_parallel_size": 2}, ["dpo", "dpo_packed", "kto"]),
    "cp2": ({"model.context_parallel_size": 2}, ["dpo", "dpo_packed", "kto"]),
    "dp2": ({}, ["dpo", "kto"]),
}
RUNS = [f"{name}/{case}" for name, (_, cases) in LAYOUTS.items() for case in cases]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_assets):
    workdir = tmp_path_factory.mktemp("preference_parity")
    tokenizer = str(tiny_assets / "tokenizer")
    launch("tests.preference_workers:main", ["reference", str(workdir), tokenizer], 1, log_dir=workdir / "logs_ref")
    launch("tests.preference_workers:main", ["parallel", str(workdir), tokenizer, json.dumps(LAYOUTS)], 2,
           log_dir=workdir / "logs_parallel")
    return workdir


@pytest.mark.dist
def test_reference_modes_packing_and_first_loss(workdir):
    checks = json.loads((workdir / "reference_checks.json").read_text())
    print(checks)
    # policy == reference at the first step: DPO's preference term is ln 2, accuracy is chance (ties count 1/2),
    # and KTO scores lambda / 2 per sample (desirable_weight 1, undesirable_weight 1.5)
    dpo, kto = checks["dpo_first_step"], checks["kto_first_step"]
    assert dpo["loss/preference"] == pytest.approx(math.log(2), abs=1e-6) and dpo["accuracy"] == 0.5
    assert dpo["loss"] == pytest.approx(math.log(2) + 0.1 * dpo["loss/sft"], abs=1e-6)
    fraction = kto["fraction/desirable"]
    assert kto["loss"] == pytest.approx(0.5 * fraction + 0.75 * (1 - fraction), abs=1e-6) and kto["kl"] == 0.0
    for mode in ("dpo_cpu_swap", "kto_precompute", "dpo_precompute"):
        assert checks[mode]["metrics"] < 1e-5 and checks[mode]["grads"] < 1e-5 and checks[mode]["params"] < 1e-4, mode
    packed = checks["dpo_packed_vs_padded"]
    assert packed["metrics"] < 1e-4 and packed["grads"] < 1e-5 and packed["params"] < 1e-4


@pytest.mark.dist
@pytest.mark.parametrize("run", RUNS)
def test_matches_single_process(workdir, run):
    diff = json.loads((workdir / "parallel_diffs.json").read_text())[run]
    print(run, diff)
    assert diff["metrics"] < 1e-5 and diff["grad_norm"] < 1e-5
    assert diff["grads"] < 1e-5
    assert diff["params"] < 1e-4
