"""SPIN end to end on a weak SFT model: the reference is reset at every iteration boundary (the first
step of each iteration has loss ln 2: policy = reference), DPO pulls the policy towards the ground
truth within each iteration, its greedy generations reproduce more of the ground truth from one
iteration to the next, a run resumed inside an iteration continues it bitwise, and DP=2 / TP=2 / PP=2
runs match one process."""
from __future__ import annotations

import math

import pytest

from tests.conftest import read_metrics, run_cli

STEPS_PER_ITERATION, STEPS = 4, 12


@pytest.fixture(scope="module")
def weak_policy(tiny_assets, tmp_path_factory):
    from aligner.data.synthetic import write_sft_chat

    root = tmp_path_factory.mktemp("spin")
    write_sft_chat(root / "sft.jsonl", 400, seed=1, max_operand=4)
    write_sft_chat(root / "prompts.jsonl", 64, seed=3, max_operand=4)
    result = run_cli("train", "sft", f"run_dir={root / 'sft'}", f"data.train_path={root / 'sft.jsonl'}",
                     f"tokenizer.path={tiny_assets / 'tokenizer'}", "trainer.max_steps=40", "optim.lr=3e-3",
                     "optim.warmup_steps=5", "logging.progress=false", "logging.tensorboard=false")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def spin(assets, root, run_dir, *extra):
    result = run_cli("train", "spin", f"run_dir={run_dir}", f"data.train_path={root / 'prompts.jsonl'}",
                     f"tokenizer.path={assets / 'tokenizer'}", f"model.pretrained={root / 'sft/checkpoints/step_000040'}",
                     f"spin.steps_per_iteration={STEPS_PER_ITERATION}", "spin.greedy=true", "spin.max_new_tokens=8",
                     "optim.lr=3e-4", "optim.min_lr=1e-5", "optim.scheduler=constant", "dpo.beta=0.5",
                     "logging.progress=false", "logging.tensorboard=false", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def straight(tiny_assets, weak_policy, tmp_path_factory):
    """Three iterations in one process, uninterrupted: the run of the first test, and the reference of the
    others, which compare their 8 steps (two iterations) with its first 8. Those equal an 8-step run's bitwise
    (every metric but timings: the constant lr and the iterations do not depend on trainer.max_steps), so one
    run serves both (there were two)."""
    return spin(tiny_assets, weak_policy, tmp_path_factory.mktemp("straight"), f"trainer.max_steps={STEPS}")


def test_spin_iterations_reset_the_reference_and_move_towards_the_ground_truth(straight):
    metrics = straight
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["spin/iteration"] for m in metrics] == [s // STEPS_PER_ITERATION for s in range(STEPS)]
    firsts = metrics[::STEPS_PER_ITERATION]
    for first, last in zip(firsts, metrics[STEPS_PER_ITERATION - 1::STEPS_PER_ITERATION]):
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # a fresh reference equals the policy
        assert abs(first["reward/margin"]) < 1e-5
        assert last["reward/margin"] > 0.05 and last["loss"] < first["loss"]  # ground truth preferred
    assert all("spin/gen_match" in m for m in firsts)
    assert not any("spin/gen_match" in m for m in metrics if m not in firsts)
    match, exact = [m["spin/gen_match"] for m in firsts], [m["spin/exact"] for m in firsts]
    print(f"SPIN greedy generations vs ground truth per iteration: token match {match}, identical {exact}")
    assert match[-1] > match[0] and exact[-1] > exact[0]


def test_spin_resumes_inside_an_iteration_bitwise(tiny_assets, weak_policy, straight, tmp_path):
    run_dir = tmp_path / "resumed"
    spin(tiny_assets, weak_policy, run_dir, "trainer.max_steps=6")  # stops inside iteration 1
    assert (run_dir / "spin" / "iteration_1.pt").exists()
    resumed = spin(tiny_assets, weak_policy, run_dir, "trainer.max_steps=8")
    assert [m["step"] for m in resumed] == list(range(1, 9))
    for ours, ref in zip(resumed, straight):
        for key in ("loss", "grad_norm", "reward/margin", "accuracy"):
            assert ours[key] == ref[key], (ours["step"], key)


@pytest.mark.parametrize("layout", [["launcher.nproc_per_node=2"],
                                    ["launcher.nproc_per_node=2", "model.tensor_model_parallel_size=2"],
                                    ["launcher.nproc_per_node=2", "model.pipeline_model_parallel_size=2"]],
                         ids=["dp2", "tp2", "pp2"])
def test_spin_on_two_ranks_matches_one_process(tiny_assets, weak_policy, straight, tmp_path, layout):
    """Generation split over data-parallel replicas (or tensor- / pipeline-parallel), then DPO: the same two
    iterations."""
    ours = spin(tiny_assets, weak_policy, tmp_path / "run", "trainer.max_steps=8", *layout)
    assert len(ours) == 8 and len(straight) == STEPS
    for a, b in zip(ours, straight):
        assert a.get("spin/gen_match") == b.get("spin/gen_match")
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
