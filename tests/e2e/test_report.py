"""`aligner report` from outside: an unreadable run, an unwritable --out and a usage mistake each give one error
line, then the report opened in a real headless Chromium (Debian's `chromium`): it loads with no console error
and no request beyond its own file, every chart has drawn data, a multi-turn episode shows its turns, and a
screenshot is saved to
tests/artifacts/report.png. The page's contents on synthetic runs: tests/unit/test_report_html.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aligner.errors import UsageError
from aligner.observe import report
from tests.conftest import run_cli
from tests.unit.test_report_html import grpo_row, make_run, write_two_runs

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.fixture
def two_runs(tmp_path):
    return write_two_runs(tmp_path)


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


# ---- the report in a real browser ---------------------------------------------------------------------------
DRAWN = """() => [...document.querySelectorAll('.chart')].map(chart => ({
  title: chart.dataset.title,
  lines: [...chart.querySelectorAll('.scatterlayer path.js-line')].filter(p => (p.getAttribute('d') || '').length > 2).length,
  points: chart.querySelectorAll('.scatterlayer path.point').length}))"""
# a multi-turn episode's turns as laid out: role, reward badge, text, and whether the box has a size on the page
TURNS = """() => [...document.querySelectorAll('li.turn')].map(turn => ({
  role: turn.querySelector('.role').innerText, text: turn.querySelector('.turn-text').innerText,
  reward: (turn.querySelector('.turn-reward') || {}).innerText || null,
  shown: turn.getBoundingClientRect().height > 0}))"""


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
            seen["turns"] = page.evaluate(TURNS)
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
    assert seen["turns"] == [  # step 29's multi-turn episode, turn by turn
        {"role": "assistant", "text": "<calc>47*58</calc>", "reward": None, "shown": True},
        {"role": "tool", "text": "2726", "reward": None, "shown": True},
        {"role": "assistant", "text": "2726", "reward": "reward 1", "shown": True}]
