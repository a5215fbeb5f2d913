"""`aligner report` (aligner/observe/report.py): the families, config diff, escaping and errors on synthetic
run directories, then the report opened in a real headless Chromium (Debian's `chromium`): it loads with no
console error and no request beyond its own file, every chart has drawn data, and a screenshot is saved to
tests/artifacts/report.png."""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import yaml

from aligner.errors import UsageError
from aligner.observe import report, report_html
from tests.conftest import run_cli

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
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


GRPO_CONFIG = {"algorithm": {"advantage": "grpo", "kl": {"coef": 0.01}}, "optim": {"lr": 1e-5}, "trainer": {"seed": 1}}
PPO_CONFIG = {"algorithm": {"advantage": "gae", "kl": {"coef": 0.02}}, "optim": {"lr": 1e-5}, "trainer": {"seed": 1},
              "critic": {"url": None}}


@pytest.fixture
def two_runs(tmp_path):
    """A GRPO run (validation at step 0, a hostile rollout) and a PPO run under the same directory name."""
    grpo_rows = [{"step": 0, "val/reward/mean": 0.05, "val/math/mean": 0.1}]
    grpo_rows += [{**grpo_row(s), **({"val/reward/mean": 0.1 + 0.01 * s} if s % 5 == 0 else {})} for s in range(1, 31)]
    grpo = make_run(tmp_path / "a", "rl", grpo_rows, GRPO_CONFIG,
                    {s: [sample(s, k, HOSTILE if s == 30 else "2+2=") for k in range(4)] for s in range(1, 31)})
    ppo = make_run(tmp_path / "b", "rl", [ppo_row(s) for s in range(1, 21)], PPO_CONFIG,
                   {20: [sample(20, k) for k in range(2)]})
    return grpo, ppo


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


def test_cli_writes_the_default_file(two_runs, capsys):
    grpo, _ = two_runs
    assert report.main([str(grpo)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {grpo / 'report.html'}"
    assert (grpo / "report.html").stat().st_size > 1_000_000  # plotly.js is inside
    assert not list(grpo.glob("*.partial"))


def assert_one_error_line(result, code: int, start: str) -> None:
    """The CLI's one `error:` line (aligner.errors), last on stderr: its start, the exit code, no traceback."""
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.stderr
    assert lines[-1].startswith(start) and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("case", ["missing", "no_metrics", "bad_metrics_line"])
def test_an_unreadable_run_gives_one_error_line(tmp_path, case):
    run = tmp_path / "run"
    if case == "bad_metrics_line":
        make_run(tmp_path, "run", [grpo_row(1), grpo_row(2)])
        (run / "metrics.jsonl").write_text("not json\n" + (run / "metrics.jsonl").read_text())
    elif case == "no_metrics":
        run.mkdir()
    result = run_cli("report", str(run), "--out", str(tmp_path / "r.html"))
    start = {"missing": f"error: run directory not found, {run}, pass the run_dir of an 'aligner train' run",
             "no_metrics": f"error: no metrics.jsonl in the run directory, {run}, pass the run_dir of an 'aligner train'",
             "bad_metrics_line": f"error: metrics line 1 is not JSON, {run / 'metrics.jsonl'}:1, fix or delete"}[case]
    assert_one_error_line(result, 1, start)
    assert not (tmp_path / "r.html").exists()


def test_an_unwritable_out_and_a_usage_mistake_give_one_error_line(two_runs, tmp_path):
    grpo, _ = two_runs
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run_cli("report", str(grpo), "--out", str(blocker / "r.html"))  # --out under a file
    assert_one_error_line(result, 1, "error: ")
    assert "--out is writable" in result.stderr
    assert_one_error_line(run_cli("report"), 2, "error: the following arguments are required: RUN_DIR, aligner report")
    assert_one_error_line(run_cli("report", str(grpo), "--bogus"), 2, "error: unrecognized arguments: --bogus")
    with pytest.raises(UsageError):
        report.main([])


def test_a_half_written_last_line_is_skipped(tmp_path):
    run = make_run(tmp_path, "live", [grpo_row(1), grpo_row(2)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 0.')
    assert [r["step"] for r in report.load_runs([run])[0].rows] == [1, 2]


def test_report_of_150_grpo_steps_is_cheap(tmp_path):
    run = make_run(tmp_path, "grpo", [grpo_row(s) for s in range(1, 151)], GRPO_CONFIG,
                   {s: [sample(s, k) for k in range(4)] for s in range(1, 151)})
    report.write_report([run], tmp_path / "warm.html")  # plotly.min.js is read once per process
    start = time.perf_counter()
    report.write_report([run], run / "report.html")
    elapsed = time.perf_counter() - start
    print(f"report of a 150-step GRPO run written in {elapsed * 1000:.0f} ms")
    assert elapsed < 2.0


# ---- the report in a real browser ---------------------------------------------------------------------------
DRAWN = """() => [...document.querySelectorAll('.chart')].map(chart => ({
  title: chart.dataset.title,
  lines: [...chart.querySelectorAll('.scatterlayer path.js-line')].filter(p => (p.getAttribute('d') || '').length > 2).length,
  points: chart.querySelectorAll('.scatterlayer path.point').length}))"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is not installed; the report's browser test needs it: "
                    "apt-get install -y chromium (Debian's package; Playwright must not download its own)")
    return path


def open_in_chromium(html: Path, screenshot: Path) -> dict:
    """Open `html` in headless Chromium, wait for the charts, save a full-page screenshot: what it drew
    per chart, the console/page errors, the requests it made and any dialogs."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the Playwright Python package is missing: pip install -e '.[test]' (it drives the system Chromium)")
    seen = {"errors": [], "requests": [], "dialogs": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium())
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: seen["errors"].append(str(e)))
            page.on("request", lambda r: seen["requests"].append(r.url))
            page.on("dialog", lambda d: (seen["dialogs"].append(d.message), d.dismiss()))
            page.goto(html.as_uri())
            page.wait_for_function("document.body.dataset.rendered === 'true'", timeout=20_000)
            seen["drawn"] = page.evaluate(DRAWN)
            screenshot.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    print(f"screenshot: {screenshot}")
    return seen


def test_report_renders_in_headless_chromium(two_runs, tmp_path):
    out = report.write_report(list(two_runs), tmp_path / "report.html")
    expected = [c["title"] for c in report.charts(report.load_runs(list(two_runs)))]
    seen = open_in_chromium(out, ARTIFACTS / "report.png")
    errors, requests, dialogs, drawn = seen["errors"], seen["requests"], seen["dialogs"], seen["drawn"]
    assert errors == [] and dialogs == []
    assert requests == [out.as_uri()]  # self-contained: nothing fetched beyond the file itself
    assert [d["title"] for d in drawn] == expected
    assert len(expected) == 13  # 11 metric families + a timing stack per run
    assert [d["title"] for d in drawn if d["lines"] + d["points"] == 0] == []
