"""LoRA through every other trainer's CLI (SFT, DPO, RM, GRPO and PPO: test_lora.py and
tests/integration/test_lora.py): KTO, ORPO, SPIN, SteerLM, KD (online teacher) and RS each train rank-4
adapters on the arithmetic SFT checkpoint for 2 steps and save a checkpoint of the adapters only that names
its base. The reference of KTO and SPIN is the policy at step 1 (its base, adapters off): rewards and KL 0;
SPIN's second step starts iteration 1, whose reference is the policy's adapters of that step: its rewards are
0 again although the policy moved."""
from __future__ import annotations

import json
import math

import pytest
from megatron.core.dist_checkpointing import load_tensors_metadata

from aligner.data.preference import synthetic_preferences, synthetic_unpaired, write_jsonl
from tests.conftest import assert_cli_ok, read_metrics, run_cli, write_jsonl_lines
from tests.e2e.test_rs import SCRIPTED

COMMON = ("model.lora.rank=4", "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
          "optim.warmup_steps=0", "optim.lr=1e-2", "optim.min_lr=1e-2", "optim.scheduler=constant",
          "logging.progress=false", "logging.tensorboard=false")


def steerlm_records():
    return [{"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                          {"role": "assistant", "content": str(a + b)}],
             "attributes": {"helpfulness": 4, "verbosity": a % 3}} for a in range(3) for b in range(3)]


def trainer_args(command: str, tiny_assets, rl_assets, root) -> list[str]:
    """The data file and the trainer's own keys for `command`, at the smallest shapes that run."""
    from aligner.data.synthetic import write_sft_chat

    if command == "kto":
        write_jsonl(root / "kto.jsonl", synthetic_unpaired(8, seed=3, max_operand=4))
        return [f"data.train_path={root / 'kto.jsonl'}", "kto.beta=0.5"]
    if command == "orpo":
        write_jsonl(root / "pairs.jsonl", synthetic_preferences(8, seed=4, max_operand=4))
        return [f"data.train_path={root / 'pairs.jsonl'}", "orpo.odds_ratio_weight=0.5"]
    if command == "spin":  # one step per iteration: step 2 starts iteration 1 (a renewed reference)
        write_sft_chat(root / "prompts.jsonl", 4, seed=3, max_operand=4)
        return [f"data.train_path={root / 'prompts.jsonl'}", "spin.steps_per_iteration=1", "spin.greedy=true",
                "spin.max_new_tokens=4", "dpo.beta=0.5"]
    if command == "steerlm":
        write_jsonl_lines(root / "steer.jsonl", steerlm_records())
        return [f"data.train_path={root / 'steer.jsonl'}", "steerlm.attributes=[helpfulness,verbosity]"]
    if command == "kd":  # online: the base as the teacher (no teacher-logits pass)
        write_sft_chat(root / "sft.jsonl", 8, seed=1, max_operand=9)
        return [f"data.train_path={root / 'sft.jsonl'}", f"kd.teacher={rl_assets / 'sft/checkpoints/step_000040'}",
                "kd.top_k=8", "kd.sft_loss_weight=1"]
    assert command == "rs"
    return [f"data.train_path={rl_assets / 'target.jsonl'}", f"reward.functions=[{SCRIPTED}]", "reward.workers=1",
            "rs.prompts_per_step=2", "rs.num_rollouts_per_prompt=2", "rs.top_n=2", "rs.log_rollouts=0",
            "sampling.max_new_tokens=4", "data.shuffle=false"]


@pytest.mark.parametrize("command", ["kto", "orpo", "spin", "steerlm", "kd", "rs"])
def test_trainer_with_adapters(command, tiny_assets, rl_assets, tmp_path):
    base = rl_assets / "sft/checkpoints/step_000040"
    run_dir = tmp_path / "run"
    assert_cli_ok(run_cli("train", command, f"run_dir={run_dir}", f"tokenizer.path={tiny_assets / 'tokenizer'}",
                          f"model.pretrained={base}", *COMMON, *trainer_args(command, tiny_assets, rl_assets, tmp_path)))
    ckpt = run_dir / "checkpoints" / "step_000002"
    meta = json.loads((ckpt / "aligner.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["path"] == str(base.resolve())
    names = sorted(load_tensors_metadata(str(ckpt / "weights")))
    assert names and all(".lora." in name for name in names), names  # no scalar head in these trainers

    metrics = [m for m in read_metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)
    assert all(math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in metrics)
    first, second = metrics
    print(command, [{k: v for k, v in m.items() if not k.startswith(("timing/", "throughput/"))} for m in metrics])
    if command == "kto":  # the reference is the base = the policy at step 1, and stays the base
        assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["reward/margin"] == pytest.approx(0.0, abs=1e-6)
        assert second["kl"] > 1e-3
    if command == "spin":  # each step begins an iteration: its reference is the policy then
        assert [m["spin/iteration"] for m in metrics] == [0, 1]
        assert (run_dir / "checkpoints" / "step_000001").exists()  # the boundary of iteration 1
        for m in metrics:
            assert m["loss"] == pytest.approx(math.log(2), abs=1e-6)
            assert abs(m["reward/chosen"]) < 1e-5 and abs(m["reward/margin"]) < 1e-5
        # the policy moved (the same chosen sequences, 4 prompts in a batch of 4): against the base, step 2's
        # reward/chosen would be dpo.beta times this difference
        assert abs(second["logps/chosen"] - first["logps/chosen"]) > 1e-3
    if command == "steerlm":
        assert meta["steerlm"] == {"attributes": ["helpfulness", "verbosity"], "scale": 4}
    if command == "kd":  # the teacher is the base: the student (base + zero B) equals it at step 1
        assert first["kd/loss"] == pytest.approx(0.0, abs=1e-6) and second["kd/loss"] > 0
        assert all(m["loss"] == pytest.approx(m["kd/loss"] + m["sft/loss"], rel=1e-5) for m in metrics)


def test_spin_with_adapters_resumes_inside_an_iteration(tiny_assets, rl_assets, tmp_path):
    """Two steps per iteration: a run stopped after step 3 resumes inside iteration 1, whose reference (the
    policy's adapters at step 2) it reads back from the boundary checkpoint; its steps equal a straight run's."""
    def spin(run_dir, steps):
        assert_cli_ok(run_cli("train", "spin", f"run_dir={run_dir}", f"tokenizer.path={tiny_assets / 'tokenizer'}",
                              f"model.pretrained={rl_assets / 'sft/checkpoints/step_000040'}", *COMMON,
                              *trainer_args("spin", tiny_assets, rl_assets, tmp_path), "spin.steps_per_iteration=2",
                              f"trainer.max_steps={steps}", "trainer.save_interval=1"))
        return [m for m in read_metrics(run_dir) if "loss" in m]

    straight = spin(tmp_path / "straight", 4)
    spin(tmp_path / "resumed", 3)
    resumed = spin(tmp_path / "resumed", 4)
    assert [m["spin/iteration"] for m in straight] == [0, 0, 1, 1] and resumed[-1]["step"] == 4
    for key in ("loss", "reward/chosen", "reward/margin", "grad_norm"):
        assert resumed[-1][key] == straight[-1][key], key
    assert abs(straight[-1]["reward/margin"]) > 1e-6  # step 4's reference is step 2's policy, not its own
