"""LoRA through the CLI: GRPO with rank-8 adapters refits bitwise (the engine decodes with the adapted
weights) at the full model's mismatch level, saves checkpoints of its adapters only that name their
base, resumes bitwise after SIGKILL; a LoRA checkpoint is a `model.pretrained` and an `aligner generate`
model (merged), and one whose base changed since is refused, naming both fingerprints."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_cli, sigkill_once_logged, start_cli
from tests.e2e.test_rl_loop import grpo, grpo_args

LORA = ("model.lora.rank=8", "model.lora.alpha=16", "generation.check_refit=true", "trainer.max_steps=4",
        "trainer.save_interval=2")
KEYS = ("loss", "grad_norm", "reward/mean", "kl/mean", "entropy/mean", "advantages/std")


@pytest.fixture(scope="module")
def straight(tiny_assets, rl_assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_straight")
    return run_dir, grpo(tiny_assets, rl_assets, run_dir, *LORA)


def test_grpo_with_adapters_refits_and_saves_only_them(rl_assets, straight):
    run_dir, metrics = straight
    trained = [m for m in metrics if "loss" in m]
    assert len(trained) == 4
    assert all(m["refit/bitwise"] == 1.0 and m["refit/max_abs_diff"] == 0.0 for m in trained)
    assert all(m["mismatch/kl"] < 1e-6 and abs(m["mismatch/token_prob_error"] - 1.0) < 1e-5 for m in trained)
    assert all(m["kl/mean"] >= 0 for m in trained) and trained[-1]["kl/mean"] > 0  # the base as reference
    ckpt = run_dir / "checkpoints" / "step_000004"
    meta = json.loads((ckpt / "aligner.json").read_text())
    base = rl_assets / "sft/checkpoints/step_000040"
    assert meta["lora"]["rank"] == 8 and meta["lora"]["base"]["path"] == str(base.resolve())
    assert "lora" not in meta["model"]
    size = sum(f.stat().st_size for f in (ckpt / "weights").rglob("*") if f.is_file())
    base_size = sum(f.stat().st_size for f in (base / "weights").rglob("*") if f.is_file())
    print(f"LoRA checkpoint weights {size} bytes, base {base_size}")
    assert size < base_size / 5


def test_grpo_with_adapters_resumes_bitwise_after_sigkill(tiny_assets, rl_assets, straight, tmp_path):
    run_dir = tmp_path / "killed"
    # killed once step 3 is logged (its checkpoint is step 2)
    sigkill_once_logged(start_cli(*grpo_args(tiny_assets, rl_assets, run_dir, *LORA)), run_dir, 3)
    resumed = grpo(tiny_assets, rl_assets, run_dir, *LORA)
    assert [m["step"] for m in resumed] == [m["step"] for m in straight[1]]
    for ours, ref in zip(resumed, straight[1]):
        for key in KEYS:
            assert ours.get(key) == ref.get(key), (ours["step"], key)


def test_lora_checkpoint_as_model_and_a_changed_base_is_refused(tiny_assets, rl_assets, tmp_path):
    """A LoRA checkpoint generates (its base with the adapters merged) and is the base of the next LoRA stage;
    after its own base is rewritten, it and the next stage's checkpoint are refused in one line naming the
    two fingerprints."""
    base = tmp_path / "base"
    shutil.copytree(rl_assets / "sft/checkpoints/step_000040", base)

    def sft_args(run_dir, pretrained, steps):
        return ("train", "sft", f"run_dir={run_dir}", f"data.train_path={rl_assets / 'sft.jsonl'}",
                f"tokenizer.path={tiny_assets / 'tokenizer'}", f"model.pretrained={pretrained}", "model.lora.rank=4",
                f"trainer.max_steps={steps}", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
                "logging.progress=false")

    sft = run_cli(*sft_args(tmp_path / "sft", base, 2))
    assert sft.returncode == 0, sft.stderr[-3000:]
    adapted = tmp_path / "sft/checkpoints/step_000002"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n')
    out = tmp_path / "gen.jsonl"
    generate = ("generate", "--model", str(adapted), "--prompts", str(prompts), "--out", str(out),
                "sampling.greedy=true", "sampling.max_new_tokens=4")
    result = run_cli(*generate)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(out.read_text())["response"]
    # the next stage: LoRA again, on the first one's merged weights (a chain of bases)
    chained = run_cli(*sft_args(tmp_path / "next", adapted, 1))
    assert chained.returncode == 0, chained.stderr[-3000:]
    meta = json.loads((tmp_path / "next/checkpoints/step_000001/aligner.json").read_text())
    assert meta["lora"]["base"]["path"] == str(adapted.resolve())
    meta = json.loads((base / "aligner.json").read_text())
    meta["trainer_state"]["step"] = 41  # the base is rewritten (here: its metadata)
    (base / "aligner.json").write_text(json.dumps(meta))
    expected = json.loads((adapted / "aligner.json").read_text())["lora"]["base"]["fingerprint"]
    for model in (adapted, tmp_path / "next/checkpoints/step_000001"):  # directly, and as the base of a base
        result = run_cli(*generate[:2], str(model), *generate[3:])
        assert result.returncode != 0
        line = next(line for line in result.stderr.splitlines() if "changed since the adapters were saved" in line)
        assert f"expected {expected}" in line and str(base.resolve()) in line
    # on two ranks rank 0 reads the fingerprint and both refuse in one line (neither is left in a collective)
    two = [arg.replace("micro_batch_size=4", "micro_batch_size=2") for arg in sft_args(tmp_path / "two", adapted, 1)]
    result = run_cli(*two, "launcher.nproc_per_node=2", timeout=120)
    assert result.returncode != 0 and f"expected {expected}" in result.stderr, result.stderr[-3000:]
