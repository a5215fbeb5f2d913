"""Multi-turn GRPO end to end (env.name, aligner/envs): episodes with an environment between the turns train,
report their episode metrics, and a SIGKILLed run resumes to the uninterrupted run's metrics."""
from __future__ import annotations

import json

from tests.conftest import start_cli, write_jsonl_lines
from tests.e2e.test_rl_async import KEYS, kill_when_logged
from tests.e2e.test_rl_loop import grpo, grpo_args

EPISODES = ("env.name=tests.env_fixtures:Scripted", "env.max_turns=3", "env.concurrency=2",
            "reward.functions=[arithmetic]", "trainer.max_steps=4", "trainer.save_interval=2")


def test_multiturn_grpo_trains_and_resumes_after_sigkill(tiny_assets, rl_assets, tmp_path):
    records = [json.loads(line) for line in (rl_assets / "prompts.jsonl").read_text().splitlines()]
    prompts = tmp_path / "episodes.jsonl"  # Scripted: `tool_turns` tool turns, then the scored answer
    write_jsonl_lines(prompts, [json.dumps({**r, "seed": i, "tool_turns": i % 3}) for i, r in enumerate(records)])
    args = (f"data.train_path={prompts}", *EPISODES)
    straight = grpo(tiny_assets, rl_assets, tmp_path / "straight", *args)
    assert [m["step"] for m in straight] == [1, 2, 3, 4]
    assert all(1.0 < m["episode/turns_mean"] <= 3.0 and m["fraction/env_errors"] == 0.0 for m in straight)
    assert all("timing/env_s" in m and m["grad_norm"] == m["grad_norm"] for m in straight)  # learned (not NaN)
    run_dir = tmp_path / "killed"
    process = start_cli(*grpo_args(tiny_assets, rl_assets, run_dir, *args))
    kill_when_logged(process, run_dir, 3)
    process.wait()
    resumed = grpo(tiny_assets, rl_assets, run_dir, *args)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for ours, ref in zip(resumed, straight):
        for key in KEYS + ("episode/turns_mean", "episode/tool_calls_mean"):
            assert ours.get(key) == ref.get(key), (ours["step"], key)
