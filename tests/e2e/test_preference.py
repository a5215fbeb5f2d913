"""Preference optimisation end to end through the CLI (DPO's learning: tests/e2e/test_example.py): bitwise
resume with packing and cached reference log-probs, KTO moving its metrics the right way, ORPO and SimPO runs,
and errors before or at start-up."""
import pytest

from aligner.data.preference import synthetic_preferences, synthetic_unpaired, write_jsonl
from tests.conftest import assert_cli_ok, assert_metrics_match_by_step, read_metrics, run_cli


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference_data")
    # "What is a+b?" with a, b in 0..4: the chosen answer is right, the rejected one off by 1..5.
    write_jsonl(root / "train.jsonl", synthetic_preferences(800, seed=1, max_operand=4))
    write_jsonl(root / "val.jsonl", synthetic_preferences(128, seed=2, max_operand=4))  # held-out pairs
    write_jsonl(root / "kto.jsonl", synthetic_unpaired(800, seed=3, max_operand=4))
    write_jsonl(root / "small.jsonl", synthetic_preferences(64, seed=4, max_operand=4))
    return root


def args(command, assets, data, run_dir, train, *extra):
    return ["train", command, f"run_dir={run_dir}", f"data.train_path={data / train}",
            f"tokenizer.path={assets / 'tokenizer'}", "logging.progress=false", "logging.tensorboard=false", *extra]


def mean(metrics, key):
    return sum(m[key] for m in metrics) / len(metrics)


def test_dpo_resume_is_bitwise_with_packing_and_cached_reference(tiny_assets, data, tmp_path):
    common = ["data.packing=true", "reference.mode=precompute", "trainer.global_batch_size=8",
              "trainer.micro_batch_size=4", "trainer.save_interval=2", "optim.lr=1e-3", "optim.warmup_steps=1",
              "optim.decay_steps=4"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert_cli_ok(run_cli(*args("dpo", tiny_assets, data, full, "small.jsonl", "trainer.max_steps=4", *common)))
    assert_cli_ok(run_cli(*args("dpo", tiny_assets, data, split, "small.jsonl", "trainer.max_steps=2", *common)))
    assert (split / "reference" / "train.pt").exists()
    result = run_cli(*args("dpo", tiny_assets, data, split, "small.jsonl", "trainer.max_steps=4", *common))
    assert_cli_ok(result)
    assert "resumed from" in result.stderr and "reference log-probs for train read from" in result.stderr
    resumed = read_metrics(split)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert_metrics_match_by_step(resumed, read_metrics(full),
                                 ("loss", "accuracy", "reward/margin", "grad_norm", "lr", "consumed_samples"))


def test_kto_moves_its_metrics_the_right_way(tiny_assets, data, tmp_path):
    run_dir = tmp_path / "kto"
    assert_cli_ok(run_cli(*args("kto", tiny_assets, data, run_dir, "kto.jsonl", "trainer.max_steps=40",
                                "trainer.save_last=false", "optim.lr=1e-3", "optim.min_lr=1e-4", "kto.beta=0.5")))
    metrics = read_metrics(run_dir)
    for key in ("loss", "kl", "reward/desirable", "reward/undesirable", "reward/margin", "logps/desirable",
                "logps/undesirable", "fraction/desirable"):
        assert key in metrics[0], key
    assert metrics[0]["reward/margin"] == pytest.approx(0.0, abs=1e-6) and metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    early, late = metrics[:10], metrics[-10:]
    print({k: (mean(early, k), mean(late, k)) for k in ("loss", "reward/margin", "reward/undesirable", "kl")})
    assert mean(late, "reward/margin") > mean(early, "reward/margin") + 0.1  # desirable pulled above undesirable
    assert mean(late, "reward/undesirable") < 0  # undesirable completions pushed below the reference
    assert mean(late, "loss") < mean(early, "loss")


@pytest.mark.parametrize("command, extra", [("orpo", ["orpo.odds_ratio_weight=0.5"]),
                                            ("simpo", ["simpo.beta=2.0", "simpo.gamma=0.5"])])
def test_reference_free_algorithms_run(tiny_assets, data, tmp_path, command, extra):
    run_dir = tmp_path / command
    assert_cli_ok(run_cli(*args(command, tiny_assets, data, run_dir, "train.jsonl", f"data.val_path={data / 'val.jsonl'}",
                                "trainer.max_steps=6", "trainer.val_interval=6", "trainer.val_batches=1",
                                "trainer.save_last=false", "optim.lr=1e-3", "data.packing=true", *extra)))
    metrics = read_metrics(run_dir)
    assert len(metrics) == 6 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert {"accuracy", "logps/chosen", "logps/rejected", "val/loss", "val/accuracy"} <= set(metrics[-1])


def test_errors_name_the_problem(tiny_assets, data, tmp_path):
    result = run_cli(*args("dpo", tiny_assets, data, tmp_path / "a", "train.jsonl", "dpo.loss_type=nope"))
    assert result.returncode == 2 and "dpo.loss_type" in result.stderr
    result = run_cli(*args("kto", tiny_assets, data, tmp_path / "b", "kto.jsonl", "reference.mode=elsewhere"))
    assert result.returncode == 2 and "reference.mode" in result.stderr
    # reward-aware losses need per-pair rewards: the data error names the file and line
    result = run_cli(*args("dpo", tiny_assets, data, tmp_path / "c", "train.jsonl", "dpo.loss_type=rpo_sq",
                           "trainer.max_steps=1"))
    assert result.returncode == 1
    assert f"{data / 'train.jsonl'}:1: expected 'chosen_reward' to be a finite number" in result.stderr
