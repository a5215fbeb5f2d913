"""Reward-model training end to end: `aligner train rm` (padded) learning a synthetic preference task at TP=1,
with PP=2, CP=2 and DP=2 reproducing the TP=1 losses and gradient norms, and packed pairs (the default
on the local layer spec; TP=1, TP=2, PP=2, CP=2) reproducing the padded ones. The losses by hand:
tests/unit/test_rm_losses.py; the data formats: tests/unit/test_rm_data.py."""
from __future__ import annotations

import json

import pytest

from tests.conftest import assert_cli_ok, read_metrics, run_cli, write_jsonl_lines


# ---- training through the CLI -------------------------------------------------------------------------
def _far_miss_pairs(n: int, seed: int) -> list[dict]:
    """Right answer against it moved by 1..10 (kept >= 0): a model trained from scratch learns these in 60
    steps, helped by the skew (small answers are chosen more often than rejected). The example's twins
    (`arithmetic_preferences`) remove that skew and need the SFT model's arithmetic."""
    import random

    from aligner.data.synthetic import arithmetic_problems, chat_messages

    rng = random.Random(seed + 7919)  # the pairs this test was written with
    records = []
    for problem in arithmetic_problems(n, seed, max_operand=5, ops="+"):
        right = int(problem["answer"])
        wrong = right + rng.choice([d for d in range(-10, 11) if d and right + d >= 0])
        records.append({"prompt": chat_messages(problem)[:1], "chosen": str(right), "rejected": str(wrong)})
    return records


@pytest.fixture(scope="session")
def preference_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("preferences")
    write_jsonl_lines(root / "train.jsonl", _far_miss_pairs(2000, seed=1))
    write_jsonl_lines(root / "val.jsonl", _far_miss_pairs(256, seed=2))
    return root


def rm_args(assets, data, run_dir, *extra):
    return ["train", "rm", f"run_dir={run_dir}", f"data.train_path={data / 'train.jsonl'}",
            f"tokenizer.path={assets / 'tokenizer'}", "logging.progress=false", "logging.tensorboard=false",
            "trainer.global_batch_size=32", "trainer.micro_batch_size=16", "optim.lr=1e-2", "optim.warmup_steps=5",
            "optim.decay_steps=60", *extra]


STEPS = 60
_trained: dict = {}  # the TP=1 run, once: its metrics and last checkpoint


def _train(assets, data, tmp_path_factory):
    # Padded: at this learning rate a step-3 gradient spike makes runs chaotic, so the held-out score
    # belongs to one trajectory (packed runs agree step for step but drift apart from step ~8 on,
    # from float rounding; tests/e2e/test_example.py trains the packed default end to end).
    run_dir = tmp_path_factory.mktemp("rm_tp1")
    result = run_cli(*rm_args(assets, data, run_dir, f"trainer.max_steps={STEPS}", f"trainer.val_interval={STEPS}",
                              f"data.val_path={data / 'val.jsonl'}", "trainer.val_batches=8", "data.packing=false"))
    assert_cli_ok(result)
    _trained.update(metrics=read_metrics(run_dir), checkpoint=run_dir / "checkpoints" / f"step_{STEPS:06d}")
    return run_dir, _trained["metrics"]


def test_rm_learns_held_out_preferences(tiny_assets, preference_data, tmp_path_factory):
    """At TP=1; the other layouts reproduce its steps (test_rm_parallel_layouts_match_tp1 and
    test_rm_packed_matches_padded, TP=2 among them), and the example trains the packed default end to end."""
    run_dir, metrics = _train(tiny_assets, preference_data, tmp_path_factory)
    for key in ("loss", "accuracy", "reward/margin", "reward/chosen", "reward/rejected", "grad_norm"):
        assert all(key in m for m in metrics), key
    final = metrics[-1]
    print(f"RM tp1: held-out accuracy {final['val/accuracy']:.3f}, val loss {final['val/loss']:.3f}")
    assert final["val/accuracy"] >= 0.7, final
    assert final["val/reward/margin"] > 0.5
    meta = json.loads((run_dir / "checkpoints" / f"step_{STEPS:06d}" / "aligner.json").read_text())
    assert meta["head"] == "reward" and meta["scalar_head"] == {"num_outputs": 1, "attributes": None, "loss": "bt"}


@pytest.fixture(scope="module")
def from_trained_rm(tiny_assets, preference_data, tmp_path_factory):
    """2 padded steps at TP=1 starting from a trained reward model (the other layouts start from it
    too, since initial weights drawn under PP differ from TP=1's)."""
    if not _trained:
        _train(tiny_assets, preference_data, tmp_path_factory)
    pretrained = _trained["checkpoint"]

    def run(*layout):
        run_dir = tmp_path_factory.mktemp("rm_layout")
        result = run_cli(*rm_args(tiny_assets, preference_data, run_dir, "trainer.max_steps=2",
                                  f"model.pretrained={pretrained}", *layout))
        assert_cli_ok(result)
        return read_metrics(run_dir)

    return run, run("data.packing=false")


@pytest.mark.dist
@pytest.mark.parametrize("layout", [["model.pipeline_model_parallel_size=2"], ["model.context_parallel_size=2"], []],
                         ids=["pp2", "cp2", "dp2"])
def test_rm_parallel_layouts_match_tp1(from_trained_rm, layout):
    run, reference = from_trained_rm
    assert reference[0]["accuracy"] > 0.6  # the trained head was loaded, not re-initialised
    for a, b in zip(reference, run("launcher.nproc_per_node=2", "data.packing=false", *layout)):
        for key in ("loss", "accuracy", "reward/margin", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=2e-4), (key, a[key], b[key])


@pytest.mark.dist
def test_a_pp2_reward_model_starts_from_a_language_model(tiny_assets, rl_assets, preference_data, tmp_path):
    """The language model's output layer is left unread on every stage, the first ones included (which have none:
    the checkpoint's keys that no rank read are counted over all ranks)."""
    result = run_cli(*rm_args(tiny_assets, preference_data, tmp_path / "rm", "trainer.max_steps=1",
                              f"model.pretrained={rl_assets / 'sft' / 'checkpoints' / 'step_000040'}",
                              "data.packing=false", "launcher.nproc_per_node=2",
                              "model.pipeline_model_parallel_size=2"))
    assert_cli_ok(result)
    assert read_metrics(tmp_path / "rm")[0]["loss"] > 0


@pytest.mark.parametrize("layout", [[], ["launcher.nproc_per_node=2", "model.tensor_model_parallel_size=2"],
                                    ["launcher.nproc_per_node=2", "model.pipeline_model_parallel_size=2"],
                                    ["launcher.nproc_per_node=2", "model.context_parallel_size=2"]],
                         ids=["tp1", "tp2", "pp2", "cp2"])
def test_rm_packed_matches_padded(from_trained_rm, layout):
    """data.packing=true (pair trees: a pair's prompt computed once, each reward read at its own last
    token) trains like the padded TP=1 run."""
    run, reference = from_trained_rm
    for a, b in zip(reference, run("data.packing=true", *layout)):
        assert a["loss_count"] == b["loss_count"]
        for key in ("loss", "accuracy", "reward/margin", "reward/chosen", "grad_norm"):  # fp32 summation order
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=2e-4), (key, a[key], b[key])


@pytest.mark.parametrize("packing", ["false", "true"])
def test_centering_term_in_training(from_trained_rm, packing):
    """rm.center_coef=c adds c * mean((r_chosen + r_rejected)^2) to the first step's loss (same weights,
    same batch), padded and packed alike, which is at least c * (mean r_chosen + mean r_rejected)^2."""
    run, reference = from_trained_rm
    first, plain = run(f"data.packing={packing}", "rm.center_coef=0.5")[0], reference[0]
    assert first["reward/chosen"] == pytest.approx(plain["reward/chosen"], rel=1e-3, abs=2e-4)
    added = first["loss"] - plain["loss"]
    assert added >= 0.5 * (plain["reward/chosen"] + plain["reward/rejected"]) ** 2 * (1 - 1e-3) and added > 1e-3


def test_regression_rm_learns_and_rejects_bad_config(tiny_assets, tmp_path):
    from aligner.data.synthetic import arithmetic_problems

    # two attributes: "value" (the answer, when right) is always labelled, "parity" only for odd answers
    records = []
    for p in arithmetic_problems(256, seed=3, max_operand=5, ops="+"):
        answer = int(p["answer"])
        records.append({"prompt": p["question"], "response": p["answer"],
                        "labels": {"value": answer / 10, "parity": 1.0 if answer % 2 else None}})
    data = write_jsonl_lines(tmp_path / "reg.jsonl", records)
    run_dir = tmp_path / "reg"
    args = ["train", "rm", f"run_dir={run_dir}", f"data.train_path={data}", f"tokenizer.path={tiny_assets / 'tokenizer'}",
            "logging.progress=false", "logging.tensorboard=false", "trainer.max_steps=20", "trainer.global_batch_size=32",
            "trainer.micro_batch_size=16", "optim.lr=3e-3", "optim.warmup_steps=3", "rm.loss=regression"]
    result = run_cli(*args, "rm.attributes=[value,parity]")
    assert_cli_ok(result)
    metrics = read_metrics(run_dir)
    assert metrics[-1]["loss"] < 0.3 * metrics[0]["loss"], (metrics[0]["loss"], metrics[-1]["loss"])
    assert 32 < metrics[0]["loss_count"] < 64  # every "value" label, the odd answers' "parity" labels
    meta = json.loads((run_dir / "checkpoints" / "step_000020" / "aligner.json").read_text())
    assert meta["scalar_head"] == {"num_outputs": 2, "attributes": ["value", "parity"], "loss": "regression"}
    bad = run_cli(*args[:-1], "rm.loss=hinge")
    assert bad.returncode == 2 and "rm.loss" in bad.stderr
    bad = run_cli(*args, "rm.attributes=[value]", "rm.center_coef=0.1")
    assert bad.returncode == 2 and "rm.center_coef" in bad.stderr and "regression" in bad.stderr
