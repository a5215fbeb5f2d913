"""Rejection sampling end to end (the choice of winners by hand: tests/unit/test_rs_select.py):
`aligner train rs` through the CLI keeps exactly the best samples of a scripted reward, logs the
RS metrics, resumes from a checkpoint to the same numbers and takes its first step at CP=2 as one process
does; `aligner rs-generate` writes SFT records that `load_sft_dataset` and `aligner train sft` read."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.conftest import assert_cli_ok, read_metrics, run_cli, write_jsonl_lines

SCRIPTED = "tests.e2e.test_rs:scripted"


def scripted(prompt: str, response: str, /, unscorable: bool = False, **fields) -> float | None:
    """A reward with few ties: the response's code points summed, mod 7; None for an `unscorable` record."""
    return None if unscorable else float(sum(map(ord, response)) % 7)


# ---- aligner train rs ----------------------------------------------------------------------------------
def rs_args(assets, root, run_dir, *extra):
    return ("train", "rs", f"run_dir={run_dir}", f"data.train_path={root / 'target.jsonl'}",
            f"data.val_path={root / 'val.jsonl'}", f"tokenizer.path={assets / 'tokenizer'}",
            f"model.pretrained={root / 'sft/checkpoints/step_000040'}", f"reward.functions=[{SCRIPTED}]",
            "reward.workers=1", "rs.prompts_per_step=4", "rs.num_rollouts_per_prompt=4", "rs.top_n=2",
            "rs.log_rollouts=16", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "data.shuffle=false",
            "sampling.max_new_tokens=4", "optim.lr=1e-3", "optim.min_lr=1e-3", "trainer.max_steps=4",
            "trainer.save_interval=2", "trainer.val_interval=2", "logging.progress=false",
            "logging.tensorboard=false", *extra)


@pytest.fixture(scope="module")
def straight(tiny_assets, rl_assets, tmp_path_factory):
    """Four RS steps in one run (checkpoints at steps 2 and 4): (run_dir, metrics)."""
    run_dir = tmp_path_factory.mktemp("rs") / "run"
    assert_cli_ok(run_cli(*rs_args(tiny_assets, rl_assets, run_dir)))
    return run_dir, read_metrics(run_dir)


def test_rs_keeps_the_best_samples_of_a_scripted_reward(rl_assets, straight):
    run_dir, metrics = straight
    records = [json.loads(line) for line in (rl_assets / "target.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert "val/reward/mean" in metrics[0] and "val/reward/mean" in metrics[2]
    for m in metrics[1:]:
        rows = [json.loads(line) for line in (run_dir / f"rollouts/step_{m['step']:06d}.jsonl").read_text().splitlines()]
        assert len(rows) == 16
        scorable = 0
        for p in range(4):
            group = rows[4 * p:4 * p + 4]
            record = records[(m["step"] - 1) * 4 + p]  # data.shuffle=false: the file's order
            scores = [scripted(r["prompt"], r["response"], **record) for r in group]
            assert [r["score"] for r in group] == scores  # the scorer saw these responses
            ranked = sorted((i for i, s in enumerate(scores) if s is not None), key=lambda i: (-scores[i], i))
            assert [i for i, r in enumerate(group) if r["kept"]] == sorted(ranked[:2]), (m["step"], p, scores)
            scorable += not record["unscorable"]
        kept = [r["score"] for r in rows if r["kept"]]
        scored = [r["score"] for r in rows if r["score"] is not None]
        assert m["fraction/accepted"] == scorable * 2 / 16 == len(kept) / 16  # top_n / n of each scored prompt
        assert m["fraction/unscored"] == (4 - scorable) / 4
        assert m["reward/kept_mean"] == pytest.approx(sum(kept) / len(kept))
        assert m["reward/mean"] == pytest.approx(sum(scored) / len(scored)) and m["reward/kept_mean"] >= m["reward/mean"]
        assert math.isfinite(m["loss"]) and m["loss"] > 0 and math.isfinite(m["grad_norm"])
        assert m["optimizer_steps"] == 1.0 and m["lr"] == pytest.approx(1e-3)
        for key in ("response_length/mean", "response_length/kept_mean", "fraction/ended", "timing/generate_s",
                    "timing/score_s", "timing/train_s", "timing/refit_s", "timing/step_s"):
            assert key in m, key


def test_rs_resumes_to_the_same_numbers(tiny_assets, rl_assets, straight, tmp_path):
    """Steps 3 and 4 run again from the step-2 checkpoint equal those of the straight run."""
    source, reference = straight
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    shutil.rmtree(run_dir / "checkpoints/step_000004")
    assert_cli_ok(run_cli(*rs_args(tiny_assets, rl_assets, run_dir)))
    resumed = read_metrics(run_dir)
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]
    for ours, ref in zip(resumed[3:], reference[3:]):
        for key in ("loss", "grad_norm", "reward/mean", "reward/kept_mean", "fraction/accepted",
                    "response_length/mean", "consumed_samples"):
            assert ours[key] == ref[key], (ours["step"], key)
    assert resumed[4]["val/reward/mean"] == reference[4]["val/reward/mean"]


def test_rs_first_step_under_context_parallelism_matches_one_process(tiny_assets, rl_assets, straight, tmp_path):
    """CP=2: the CP ranks generate as two replicas (the same samples, the same greedy validation), and the SFT
    pass on the winners splits each sequence over them."""
    run_dir = tmp_path / "run"
    assert_cli_ok(run_cli(*rs_args(tiny_assets, rl_assets, run_dir, "trainer.max_steps=1", "launcher.nproc_per_node=2",
                                   "model.context_parallel_size=2")))
    (val, first), (ref_val, ref) = read_metrics(run_dir), straight[1][:2]
    assert val["val/reward/mean"] == ref_val["val/reward/mean"]
    for key in ("reward/mean", "reward/kept_mean", "fraction/accepted", "response_length/mean"):
        assert first[key] == ref[key], key
    for key in ("loss", "grad_norm"):
        assert first[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key


# ---- aligner rs-generate ------------------------------------------------------------------------------
def test_rs_generate_writes_sft_data(tiny_assets, rl_assets, tokenizer, tmp_path):
    from aligner.data.sft import load_sft_dataset

    chat = [json.loads(line) for line in (rl_assets / "prompts.jsonl").read_text().splitlines()[:6]]
    prompts = write_jsonl_lines(tmp_path / "prompts.jsonl", chat + [{"prompt": "3+4="}, {"prompt": "5+1="}])
    out = tmp_path / "winners.jsonl"
    model = rl_assets / "sft/checkpoints/step_000040"
    result = run_cli("rs-generate", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                     "rs.num_rollouts_per_prompt=4", "rs.top_n=2", f"reward.functions=[{SCRIPTED}]", "reward.workers=1",
                     "sampling.max_new_tokens=4", "batch_size=8")
    assert_cli_ok(result)
    assert "wrote" in result.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    chats = [r for r in records if "messages" in r]
    texts = [r for r in records if "input" in r]
    assert len(chats) == 12 and len(texts) <= 4  # 2 per prompt (a text prompt's empty response is left out)
    for k in range(0, 12, 2):  # a prompt's two winners, best first, under its own messages
        first, second = chats[k], chats[k + 1]
        assert first["messages"][:-1] == chat[k // 2]["prompt"] == second["messages"][:-1]
        assert first["reward"] >= second["reward"]
    for r in chats:
        assert r["reward"] == scripted("", r["messages"][-1]["content"])
    for r in texts:
        assert r["input"] in ("3+4=", "5+1=") and r["reward"] == scripted("", r["output"])
    data = load_sft_dataset(out, tokenizer, max_length=128)
    assert len(data) == len(records) and all(any(s.loss_mask) for s in data)
    run_dir = tmp_path / "sft"
    assert_cli_ok(run_cli("train", "sft", f"run_dir={run_dir}", f"data.train_path={out}",
                          f"tokenizer.path={tiny_assets / 'tokenizer'}", f"model.pretrained={model}",
                          "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
                          "logging.progress=false", "logging.tensorboard=false"))
    assert all(math.isfinite(m["loss"]) for m in read_metrics(run_dir))


def test_rs_generate_usage_errors(rl_assets, tmp_path):
    model = rl_assets / "sft/checkpoints/step_000040"
    result = run_cli("rs-generate", "--model", str(model), "--prompts", str(rl_assets / "prompts.jsonl"),
                     "--out", str(tmp_path / "o.jsonl"), "optim.lr=1")
    assert result.returncode == 2 and "unknown override 'optim.lr'" in result.stderr
    result = run_cli("rs-generate", "--model", str(model), "--prompts", str(tmp_path / "none.jsonl"),
                     "--out", str(tmp_path / "o.jsonl"), f"reward.functions=[{SCRIPTED}]")
    assert result.returncode != 0 and "does not exist" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()
