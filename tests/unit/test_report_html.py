"""`aligner report`'s page (aligner/observe/report.py) from synthetic run directories: the families of charts
and the empty ones left out, the timing stack, the config diff, hostile text escaped, the default output file,
a half-written last line, and a 150-step GRPO run written cheaply. The command from outside and the page in a
real browser: tests/e2e/test_report.py."""
from __future__ import annotations

import html
import json
import math
import re
import time
from pathlib import Path

import pytest
import yaml

from aligner.observe import report, report_html

HOSTILE = "<script>alert(1)</script>"
GRPO_TIMING = {"generate": 0.4, "logprobs": 0.05, "reference": 0.1, "score": 0.3, "score_wait": 0.02, "train": 0.5,
               "refit": 0.001}


# ---- synthetic run directories --------------------------------------------------------------------------
def grpo_row(step: int) -> dict:
    timing = {f"timing/{k}_s": v * (1 + 0.1 * math.sin(step)) for k, v in GRPO_TIMING.items()}
    return {"step": step, "reward/mean": 0.1 + 0.005 * step, "reward/std": 0.2, "response_length/mean": 40.0 + step,
            "fraction/ended": 0.5, "loss": 0.1 / (1 + step), "lr": 1e-5, "grad_norm": 1.0 + 0.1 * math.cos(step),
            "entropy/mean": 2.0 - 0.01 * step, "policy/clip_fraction": 0.02, "policy/approx_kl": 1e-3,
            "kl/mean": 1e-3 * step, **timing, "timing/step_s": sum(timing.values()) - timing["timing/score_s"] + 0.05,
            "throughput/generated_tokens_per_s": 5000.0, "consumed_samples": 8.0 * step}


def ppo_row(step: int) -> dict:
    return {**grpo_row(step), "value/loss": 0.5 / step, "value/clip_fraction": 0.1, "kl/coef": 0.02,
            "timing/critic_wait_s": 0.1, "timing/critic_infer_server_s": 0.3}


def sft_row(step: int) -> dict:
    return {"step": step, "loss": 2.0 / step, "lr": 1e-4, "grad_norm": float("nan"), "loss_count": 100.0,
            "timing/step_s": 0.2, "throughput/tokens_per_s": 1000.0}


def make_run(root: Path, name: str, rows: list[dict], config: dict | None = None, rollouts: dict | None = None) -> Path:
    """A run directory as `aligner train` leaves it: metrics.jsonl, config.yaml, rollouts/step_<N>.jsonl."""
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(run), **(config or {})}, sort_keys=False))
    for step, samples in (rollouts or {}).items():
        (run / "rollouts").mkdir(exist_ok=True)
        (run / "rollouts" / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (run / "checkpoints" / f"step_{rows[-1]['step']:06d}").mkdir(parents=True)
    return run


def sample(step: int, k: int, prompt: str = "2+2=") -> dict:
    return {"prompt": prompt, "response": f"answer {step}.{k}", "score": 0.5, "reward": 0.5, "advantage": 0.1 * k,
            "valid": True, "is_end": k % 2 == 0}
def episode_sample(step: int) -> dict:
    """A multi-turn rollout row as online/rl.py writes it: the episode's turns as text, and how it ended."""
    return {"prompt": "What is 47*58?", "response": "<calc>47*58</calc>tool2726 2726", "score": 1.0, "reward": 1.0,
            "advantage": 0.5, "valid": True, "is_end": True, "version": step - 1,
            "turns": [{"role": "assistant", "text": "<calc>47*58</calc>", "reward": None},
                      {"role": "tool", "text": "2726"}, {"role": "assistant", "text": "2726", "reward": 1.0}],
            "end": "env", "error": ""}


GRPO_CONFIG = {"algorithm": {"advantage": "grpo", "kl": {"coef": 0.01}}, "optim": {"lr": 1e-5}, "trainer": {"seed": 1}}
PPO_CONFIG = {"algorithm": {"advantage": "gae", "kl": {"coef": 0.02}}, "optim": {"lr": 1e-5}, "trainer": {"seed": 1},
              "critic": {"url": None}}


def write_two_runs(root: Path) -> tuple[Path, Path]:
    """A GRPO run (validation at step 0, a hostile rollout, a multi-turn episode at step 29) and a PPO run under
    the same directory name."""
    grpo_rows = [{"step": 0, "val/reward/mean": 0.05, "val/math/mean": 0.1}]
    grpo_rows += [{**grpo_row(s), **({"val/reward/mean": 0.1 + 0.01 * s} if s % 5 == 0 else {})} for s in range(1, 31)]
    rollouts = {s: [sample(s, k, HOSTILE if s == 30 else "2+2=") for k in range(4)] for s in range(1, 31)}
    rollouts[29].append(episode_sample(29))
    grpo = make_run(root / "a", "rl", grpo_rows, GRPO_CONFIG, rollouts)
    ppo = make_run(root / "b", "rl", [ppo_row(s) for s in range(1, 21)], PPO_CONFIG,
                   {20: [sample(20, k) for k in range(2)]})
    return grpo, ppo


@pytest.fixture
def two_runs(tmp_path):
    return write_two_runs(tmp_path)


# ---- units ------------------------------------------------------------------------------------------------
def test_families_present_and_empty_ones_left_out(two_runs, tmp_path):
    runs = report.load_runs(list(two_runs))
    found = report.families(runs)
    assert list(found) == ["Loss", "Reward", "KL", "Response length", "Entropy", "Clip fraction", "Value loss",
                           "Grad norm", "Learning rate", "Throughput", "Validation"]
    assert found["Reward"] == ["reward/mean", "reward/std", "val/reward/mean"]
    assert found["Clip fraction"] == ["policy/clip_fraction", "value/clip_fraction"]
    assert found["Validation"] == ["val/math/mean"]
    assert [r.label for r in runs] == ["a/rl", "b/rl"] and [r.algorithm() for r in runs] == ["grpo", "ppo"]

    sft = report.load_runs([make_run(tmp_path, "sft", [sft_row(s) for s in range(1, 11)],
                                     {"data": {"packing": True}})])
    assert list(report.families(sft)) == ["Loss", "Learning rate", "Throughput"]  # grad_norm is all NaN: no chart
    assert sft[0].algorithm() == "sft"


def test_timing_stack_leaves_out_overlapping_phases(two_runs):
    grpo, ppo = report.load_runs(list(two_runs))
    stacked = [t["name"] for t in report.timing_chart(grpo)["traces"]]
    assert stacked == ["generate", "logprobs", "reference", "score_wait", "train", "refit", "other"]
    assert "critic_infer_server" not in [t["name"] for t in report.timing_chart(ppo)["traces"]]
    other = report.timing_chart(grpo)["traces"][-1]["y"]
    assert all(v == pytest.approx(0.05) for v in other)  # step_s minus the stacked phases


def test_config_diff_lists_the_keys_that_differ(two_runs):
    diff = report.config_diff(report.load_runs(list(two_runs)))
    assert diff == [("algorithm.advantage", ["grpo", "gae"]), ("algorithm.kl.coef", ["0.01", "0.02"]),
                    ("critic.url", [None, "null"])]  # run_dir is left out; optim.lr and trainer.seed agree


def test_hostile_text_is_escaped(two_runs, tmp_path):
    """A rollout, a metric name and a config value that would close a tag or open a script stay text."""
    odd = make_run(tmp_path / "c", "rl", [{"step": 1, f"val/{HOSTILE}/mean": 1.0}], {"note": HOSTILE})
    page = report.write_report([*two_runs, odd], tmp_path / "report.html").read_text()
    assert HOSTILE not in page
    assert page.count("<script") == 3 + report_html.plotly_js().count("<script")  # plotly.js, the data, the code
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in page  # the metric name in the JSON block
    assert "a/rl, step 30" in page and "a/rl, step 28" in page and "a/rl, step 27" not in page  # the latest 3


TURN = re.compile(r'<li class="turn( assistant)?" data-role="([^"]*)"><span class="role">[^<]*</span>'
                  r'(?:<span class="turn-reward">reward ([^<]*)</span>)?<div class="turn-text">([^<]*)</div></li>')


def test_a_multi_turn_episode_is_shown_turn_by_turn(tmp_path):
    """A rollout row with `turns` shows them in order (role, the reward of an assistant turn, the text, escaped)
    in place of its flat response, and an environment's error under them; single-turn rows beside it as before."""
    failed = {**episode_sample(3), "turns": [{"role": "assistant", "text": "<calc>1/0</calc>", "reward": None}],
              "end": "env_error", "error": "ZeroDivisionError: division by zero", "score": 0.0}
    run = make_run(tmp_path, "agent", [grpo_row(s) for s in range(1, 4)], GRPO_CONFIG,
                   {3: [episode_sample(3), failed, sample(3, 0)]})
    page = report.write_report([run], tmp_path / "report.html").read_text()
    header, *rows = re.findall(r"<tr>(.*?)</tr>", page.split("<h2>Rollout samples</h2>")[1])
    assert len(rows) == 3 and "<th>response</th>" in header and "<th>end</th>" in header
    turns = [(role, reward, html.unescape(text)) for _, role, reward, text in TURN.findall(rows[0])]
    assert turns == [("assistant", "", "<calc>47*58</calc>"), ("tool", "", "2726"), ("assistant", "1", "2726")]
    assert "<calc>47*58</calc>tool2726 2726" not in html.unescape(rows[0])  # the flat response is not repeated
    assert [t[1] for t in TURN.findall(rows[1])] == ["assistant"]
    assert "environment error: ZeroDivisionError: division by zero" in rows[1] and "<td>env_error</td>" in rows[1]
    assert 'class="turn' not in rows[2] and '<td class="text">answer 3.0</td>' in rows[2]  # single-turn: as today


def test_cli_writes_the_default_file(two_runs, capsys):
    grpo, _ = two_runs
    assert report.main([str(grpo)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {grpo / 'report.html'}"
    assert (grpo / "report.html").stat().st_size > 1_000_000  # plotly.js is inside
    assert not list(grpo.glob("*.partial"))


def test_a_half_written_last_line_is_skipped(tmp_path):
    run = make_run(tmp_path, "live", [grpo_row(1), grpo_row(2)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 0.')
    assert [r["step"] for r in report.load_runs([run])[0].rows] == [1, 2]


@pytest.mark.solo
def test_report_of_150_grpo_steps_is_cheap(tmp_path):
    run = make_run(tmp_path, "grpo", [grpo_row(s) for s in range(1, 151)], GRPO_CONFIG,
                   {s: [sample(s, k) for k in range(4)] for s in range(1, 151)})
    report.write_report([run], tmp_path / "warm.html")  # plotly.min.js is read once per process
    start = time.perf_counter()
    report.write_report([run], run / "report.html")
    elapsed = time.perf_counter() - start
    print(f"report of a 150-step GRPO run written in {elapsed * 1000:.0f} ms")
    assert elapsed < 2.0
