"""The online-RL loop end to end through the CLI (GRPO's learning: tests/e2e/test_example.py): a SIGKILLed run
resumes bitwise, the first step under DP=2 / TP=2 / PP=2 / CP=2 equals one process's, an unscorable sample is masked
out (never scored 0), the REINFORCE preset and DAPO's options run, and bad inputs fail before launch."""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.conftest import REWARDS, read_metrics, run_cli, start_cli, write_jsonl_lines


def grpo_args(assets, root, run_dir, *extra, command="grpo"):
    return ("train", command, f"run_dir={run_dir}", f"data.train_path={root / 'prompts.jsonl'}",
            f"tokenizer.path={assets / 'tokenizer'}", f"model.pretrained={root / 'sft/checkpoints/step_000040'}",
            "reward.functions=[arithmetic]", "reward.workers=1", "algorithm.prompts_per_step=4",
            "algorithm.num_generations=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
            "sampling.max_new_tokens=4", "optim.lr=1e-3", "optim.min_lr=1e-3", "trainer.val_interval=0",
            "logging.progress=false", "logging.tensorboard=false", *extra)


def grpo(assets, root, run_dir, *extra, command="grpo"):
    result = run_cli(*grpo_args(assets, root, run_dir, *extra, command=command))
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(run_dir)


def test_unscorable_samples_are_masked_not_scored_zero(tiny_assets, rl_assets, tmp_path):
    metrics = grpo(tiny_assets, rl_assets, tmp_path / "run", f"data.train_path={rl_assets / 'target.jsonl'}",
                   f"reward.functions=[{REWARDS}:unscorable_when]", "trainer.max_steps=3", "algorithm.log_rollouts=16",
                   "data.shuffle=false")
    # prompts 0, 3, 6, 9 of the 12 drawn are unscorable: their 4 samples each are masked
    assert [m["fraction/unscored"] for m in metrics] == [0.5, 0.25, 0.25]
    assert all(m["reward/mean"] == 1.0 for m in metrics)  # the mean of the scored samples only
    assert metrics[0]["fraction/valid"] == 0.5
    rows = [json.loads(line) for line in (tmp_path / "run/rollouts/step_000001.jsonl").read_text().splitlines()]
    unscored = [r for r in rows if r["score"] is None]
    assert len(unscored) == 8 and all(not r["valid"] and r["advantage"] == 0.0 for r in unscored)


@pytest.fixture(scope="module")
def straight(tiny_assets, rl_assets, tmp_path_factory):
    """Six steps in one process, uninterrupted, with a validation before the first: the reference below."""
    return grpo(tiny_assets, rl_assets, tmp_path_factory.mktemp("straight"), "trainer.max_steps=6",
                "trainer.save_interval=2", f"data.val_path={rl_assets / 'val.jsonl'}", "trainer.val_interval=3")


KEYS = ("loss", "grad_norm", "reward/mean", "kl/mean", "entropy/mean", "advantages/std", "response_length/mean")


def test_grpo_validates_before_the_first_step(straight):
    assert straight[0]["step"] == 0 and "val/reward/mean" in straight[0]
    assert [m["step"] for m in straight] == list(range(7))
    assert "val/reward/mean" in straight[3] and "val/reward/mean" in straight[6]
    for key in ("timing/generate_s", "timing/score_s", "timing/reference_s", "timing/train_s", "timing/refit_s",
                "mismatch/token_prob_error", "mismatch/kl", "policy/clip_fraction", "fraction/ended",
                "throughput/generated_tokens_per_s", *KEYS):
        assert key in straight[1], key
    assert straight[1]["mismatch/kl"] < 1e-6  # the trainer recomputes the engine's log-probs


def test_grpo_resumes_bitwise_after_sigkill(tiny_assets, rl_assets, straight, tmp_path):
    run_dir = tmp_path / "killed"
    args = grpo_args(tiny_assets, rl_assets, run_dir, "trainer.max_steps=6", "trainer.save_interval=2",
                     f"data.val_path={rl_assets / 'val.jsonl'}", "trainer.val_interval=3")
    process = start_cli(*args)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # kill it once step 3 is logged (its checkpoint is step 2)
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 4:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = grpo(tiny_assets, rl_assets, run_dir, "trainer.max_steps=6", "trainer.save_interval=2",
                   f"data.val_path={rl_assets / 'val.jsonl'}", "trainer.val_interval=3")
    assert [m["step"] for m in resumed] == list(range(7))
    for ours, ref in zip(resumed, straight):
        for key in KEYS + ("val/reward/mean",):
            assert ours.get(key) == ref.get(key), (ours["step"], key)


@pytest.mark.parametrize("layout", [["launcher.nproc_per_node=2"],
                                    ["launcher.nproc_per_node=2", "model.tensor_model_parallel_size=2"],
                                    ["launcher.nproc_per_node=2", "model.pipeline_model_parallel_size=2"],
                                    ["launcher.nproc_per_node=2", "model.context_parallel_size=2"]],
                         ids=["dp2", "tp2", "pp2", "cp2"])
def test_grpo_first_step_on_two_ranks_matches_one_process(tiny_assets, rl_assets, straight, tmp_path, layout):
    metrics = grpo(tiny_assets, rl_assets, tmp_path / "run", "trainer.max_steps=1", *layout)
    first, ref = metrics[-1], straight[1]
    for key in ("reward/mean", "response_length/mean", "advantages/std"):
        assert first[key] == ref[key], key  # the same samples: seeds per sample, not per rank
    for key in ("loss", "grad_norm", "kl/mean", "entropy/mean"):
        assert first[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("options", [
    ["algorithm.entropy_coef=0.01", "algorithm.importance_sampling.level=token"],
    ["algorithm.ratio_level=sequence", "algorithm.aggregation=seq_mean_token_sum", "algorithm.kl.mode=reward"]],
    ids=["token", "sequence"])
def test_grpo_first_step_under_context_parallelism_matches_one_process(tiny_assets, rl_assets, tmp_path, options):
    """CP=2 against one process on a step that learns: rewards that differ within groups, two optimizer
    steps (the second sees a KL, clipping and old log-probs), greedy validation before it. The CP ranks
    generate as two replicas; the passes split each sequence over them."""
    runs = [grpo(tiny_assets, rl_assets, tmp_path / name,
                 f"reward.functions=[{REWARDS}:response_length]", "trainer.global_batch_size=8", "trainer.max_steps=1",
                 f"data.val_path={rl_assets / 'val.jsonl'}", *options, *layout)
            for name, layout in (("one", []), ("cp2", ["launcher.nproc_per_node=2", "model.context_parallel_size=2"]))]
    (val, first), (cp_val, cp_first) = runs
    assert first["advantages/std"] > 0 and first["kl/mean"] > 0 and first["optimizer_steps"] == 2
    assert cp_val["val/reward/mean"] == val["val/reward/mean"]
    assert cp_val["val/response_length/mean"] == val["val/response_length/mean"]
    for key in ("reward/mean", "response_length/mean", "advantages/std"):
        assert cp_first[key] == first[key], key  # the same samples: seeds per sample, not per rank
    for key in ("loss", "grad_norm", "kl/mean", "entropy/mean", "mismatch/kl", "policy/clip_fraction"):
        assert cp_first[key] == pytest.approx(first[key], rel=1e-5, abs=1e-7), key


def test_reinforce_preset_and_dapo_options_run(tiny_assets, rl_assets, tmp_path):
    reinforce = grpo(tiny_assets, rl_assets, tmp_path / "reinforce", "trainer.max_steps=2", "sampling.top_k=3",
                     command="reinforce")
    assert all("kl/mean" in m and m["fraction/dropped_groups"] == 0 for m in reinforce)
    # top-k sampling, scored against the reference's whole distribution: at step 1 (policy = reference) the
    # KL is the top-k renormalisation, > 0 and finite (a top-k reference made it 0, and later infinite)
    assert 0 < reinforce[0]["kl/mean"] < float("inf")
    dapo = grpo(tiny_assets, rl_assets, tmp_path / "dapo", "trainer.max_steps=2", "algorithm.kl.mode=none",
                "algorithm.clip_high=0.28", "algorithm.dynamic_sampling.enabled=true", "algorithm.overlong.buffer=2",
                "algorithm.importance_sampling.level=token", "algorithm.ppo_epochs=2", "generation.check_refit=true")
    assert all("kl/mean" not in m and m["optimizer_steps"] == 2 for m in dapo)
    assert all(m["refit/bitwise"] == 1.0 and m["refit/max_abs_diff"] == 0.0 for m in dapo)  # the engine's own weights
    assert all(0 <= m["fraction/dropped_groups"] <= 1 for m in dapo)


def test_bad_inputs_fail_before_launch(tiny_assets, rl_assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    write_jsonl_lines(bad, ['{"prompt": "1+1=", "answer": "2"}', '{"question": "2+2="}'])
    result = run_cli(*grpo_args(tiny_assets, rl_assets, tmp_path / "run", f"data.train_path={bad}"))
    assert result.returncode == 1 and f"{bad}:2" in result.stderr and "'prompt'" in result.stderr  # a data error
    result = run_cli(*grpo_args(tiny_assets, rl_assets, tmp_path / "run", "reward.functions=[no_such_rule]"))
    assert result.returncode == 2 and "no_such_rule" in result.stderr
    result = run_cli(*grpo_args(tiny_assets, rl_assets, tmp_path / "run", "model.context_parallel_size=2",
                                "launcher.nproc_per_node=2", "generation.decode=megatron"))
    assert result.returncode == 2 and "generation.decode=megatron" in result.stderr  # CP generates with the lean one
    result = run_cli(*grpo_args(tiny_assets, rl_assets, tmp_path / "run", "algorithm.old_logprobs=engine",
                                "algorithm.importance_sampling.level=token"))
    assert result.returncode == 2 and "algorithm.old_logprobs=engine" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
