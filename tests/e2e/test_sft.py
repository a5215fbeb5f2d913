"""SFT end to end through the CLI: learning, metrics, checkpoints, bitwise resume, crash safety,
errors that stop before any rank starts, and a failing rank's traceback."""
import shutil

import pytest

from tests.conftest import FRESH, assert_cli_ok, assert_metrics_match_by_step, read_metrics, run_cli


def sft_args(assets, run_dir, *extra):
    return ["train", "sft", f"run_dir={run_dir}", f"data.train_path={assets / 'train.jsonl'}",
            f"tokenizer.path={assets / 'tokenizer'}", "logging.progress=false", *extra]


def test_sft_learns_and_writes_the_run_directory(tiny_assets, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(*sft_args(tiny_assets, run_dir, f"data.val_path={tiny_assets / 'val.jsonl'}",
                               "trainer.max_steps=40", "trainer.val_interval=20", "trainer.save_interval=20",
                               "optim.lr=3e-3", "optim.warmup_steps=5"))
    assert_cli_ok(result)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 41))
    for key in ("loss", "lr", "grad_norm", "timing/step_s", "throughput/tokens_per_s"):
        assert all(key in m for m in metrics), key
    assert metrics[0]["lr"] == pytest.approx(3e-3 / 5)  # warm-up starts at lr/warmup, not 0
    first, last = sum(m["loss"] for m in metrics[:5]) / 5, sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert metrics[19]["val/loss"] > metrics[39]["val/loss"]
    assert (run_dir / "config.yaml").exists() and any((run_dir / "tensorboard").iterdir())
    report = (run_dir / "report.html").read_text()  # rewritten at each checkpoint and at the end
    assert report.count('"x":') >= 2 and f"report: {run_dir / 'report.html'}" in result.stderr
    assert "saved checkpoint" in (run_dir / "logs" / "rank_0.log").read_text()
    for step in (20, 40):
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        assert (ckpt / "COMPLETE").exists() and (ckpt / "tokenizer" / "tokenizer.json").exists()


def test_a_fresh_command_shows_no_dependency_warnings(tiny_assets, tmp_path):
    """A command started fresh (no zygote: a user's shell, a Slurm job) imports torch, megatron-core and
    transformers itself, whose import-time warnings (no Transformer Engine, no Apex) must not reach the
    terminal. (The run's own warnings going to logs/warnings.log: the example's reward model and GRPO.)"""
    result = run_cli(*sft_args(tiny_assets, tmp_path / "run", "trainer.max_steps=1"), env=FRESH)
    assert_cli_ok(result)
    assert "Warning" not in result.stderr and "warn" not in result.stderr.lower(), result.stderr[-3000:]
    assert "report: " in result.stderr  # the run's own lines do reach it


@pytest.mark.parametrize("layout", [[], ["launcher.nproc_per_node=2", "optim.distributed_optimizer=true"]],
                         ids=["single", "dp2_distributed_optimizer"])
def test_resume_is_bitwise_identical_and_skips_partial_and_incomplete_checkpoints(tiny_assets, tmp_path, layout):
    """A run stopped after its step-3 checkpoint and re-run resumes from it, bitwise; beside it, a save that
    died before publishing (step_000009.partial) and one that died before COMPLETE was written (step_000008)
    are never picked."""
    # decay_steps is pinned so that the interrupted run (max_steps=3 first) has the same schedule.
    common = ["trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.save_interval=3",
              "optim.warmup_steps=2", "optim.decay_steps=6", *layout]
    full, split = tmp_path / "full", tmp_path / "split"
    assert_cli_ok(run_cli(*sft_args(tiny_assets, full, "trainer.max_steps=6", *common)))
    assert_cli_ok(run_cli(*sft_args(tiny_assets, split, "trainer.max_steps=3", *common)))
    assert [m["step"] for m in read_metrics(split)] == [1, 2, 3]
    checkpoints = split / "checkpoints"
    shutil.copytree(checkpoints / "step_000003", checkpoints / "step_000009.partial")
    shutil.copytree(checkpoints / "step_000003", checkpoints / "step_000008")
    (checkpoints / "step_000008" / "COMPLETE").unlink()
    result = run_cli(*sft_args(tiny_assets, split, "trainer.max_steps=6", *common))
    assert_cli_ok(result)
    assert "resumed from" in result.stderr and "step_000003 at step 3" in result.stderr
    resumed = read_metrics(split)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    assert_metrics_match_by_step(resumed, read_metrics(full),
                                 ("loss", "grad_norm", "lr", "loss_count", "consumed_samples"))


def test_bad_config_fails_before_any_rank_starts(tiny_assets, tmp_path):
    result = run_cli(*sft_args(tiny_assets, tmp_path / "run", "trainer.max_stepz=3", "launcher.nproc_per_node=2"))
    assert result.returncode == 2 and "max_stepz" in result.stderr
    assert not (tmp_path / "run").exists()
    result = run_cli(*sft_args(tiny_assets, tmp_path / "run", "launcher.nproc_per_node=2",
                               "model.tensor_model_parallel_size=2", "trainer.global_batch_size=6"))
    assert result.returncode == 2 and "trainer.global_batch_size=6" in result.stderr
    result = run_cli("train", "sft", f"run_dir={tmp_path / 'run'}", "data.train_path=/nonexistent.jsonl",
                     f"tokenizer.path={tiny_assets / 'tokenizer'}")
    assert result.returncode == 1 and "/nonexistent.jsonl does not exist, data.train_path" in result.stderr


def test_failing_rank_reports_file_and_line(tiny_assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = (tiny_assets / "train.jsonl").read_text().splitlines()[:20]
    lines[6] = '{"messages": [{"role": "user", "content": "hi"}'  # truncated JSON on line 7
    bad.write_text("\n".join(lines) + "\n")
    result = run_cli("train", "sft", f"run_dir={tmp_path / 'run'}", f"data.train_path={bad}",
                     f"tokenizer.path={tiny_assets / 'tokenizer'}", "launcher.nproc_per_node=2",
                     "trainer.global_batch_size=8")
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error: ")]  # once, though both ranks failed
    assert f"{bad}:7:" in line and "Traceback" not in result.stderr


def test_packed_sft_matches_padded(tiny_assets, tmp_path):
    """data.packing=true (several samples per row, block-causal attention) trains exactly like padded
    rows, at TP=1 and at TP=2."""
    runs = {}
    for name, extra in (("padded", []), ("packed", ["data.packing=true"]),
                        ("packed_tp2", ["data.packing=true", "launcher.nproc_per_node=2",
                                        "model.tensor_model_parallel_size=2"])):
        run_dir = tmp_path / name
        assert_cli_ok(run_cli(*sft_args(tiny_assets, run_dir, "trainer.max_steps=3", "trainer.save_last=false",
                                        "logging.tensorboard=false", "optim.lr=3e-3", *extra)))
        runs[name] = read_metrics(run_dir)
    for name in ("packed", "packed_tp2"):
        for ours, ref in zip(runs[name], runs["padded"]):
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
            assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), name
            assert ours["loss_count"] == ref["loss_count"]


def test_bf16_run_keeps_the_pretrained_weights_after_its_first_step(tiny_assets, rl_assets, tmp_path):
    """bf16 training keeps fp32 copies of the weights in megatron's optimizer; loaded from model.pretrained
    after the optimizer took them, they went back to the random initialisation at the first step (loss ~6.3
    here instead of the SFT policy's). At lr 0 every step's loss equals the fp32 run's to bf16 rounding."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        run_dir = tmp_path / dtype
        pretrained = rl_assets / "sft/checkpoints/step_000040"
        assert_cli_ok(run_cli(*sft_args(tiny_assets, run_dir, f"model.pretrained={pretrained}",
                                        f"model.params_dtype={dtype}", "trainer.max_steps=3", "optim.lr=0.0",
                                        "optim.min_lr=0.0", "optim.warmup_steps=0", "optim.scheduler=constant",
                                        "trainer.save_last=false", "logging.tensorboard=false")))
        losses[dtype] = [m["loss"] for m in read_metrics(run_dir)]
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-3), losses
