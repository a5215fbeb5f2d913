"""The page of `aligner report` (report.py gathers what it shows): HTML tables, the charts as plotly.js
traces in a JSON block, and plotly.min.js inlined once, so the file needs no network to open.

Everything from a run (paths, metric names, config values, prompts and responses) is HTML-escaped, and
the JSON block escapes `<`, `>` and `&`, so no text in a run can close a tag or start a script.
"""
from __future__ import annotations

import functools
import html
import importlib.util
import json
import math
import time
from pathlib import Path

from aligner.observe.report_run import ReportError, Run

# plotly.js's default colours (D3's category10): a run's colour in every chart; the dash tells its metrics
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]
DASHES = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
MARKERS_UP_TO = 50  # series this short also get a marker per point (a single point has no line)
MAX_TEXT = 2000  # characters of a prompt or response shown; the rest is cut with a note
ROLLOUT_FIELDS = ["prompt", "response", "score", "reward", "advantage", "valid", "is_end", "end"]

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.text { white-space: pre-wrap; font-family: monospace; max-width: 40em; overflow-wrap: anywhere; }
.swatch { display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.4em; }
#charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1em; }
.chart { height: 340px; border: 1px solid #eee; }
pre { background: #f8f8f8; padding: 0.5em; overflow: auto; max-height: 30em; }
.note { color: #666; }
ol.turns { list-style: none; margin: 0; padding: 0; max-width: 40em; }
li.turn { margin: 0 0 0.3em; padding: 0.2em 0.4em; border-left: 3px solid #bbb; background: #f8f8f8; }
li.turn.assistant { border-color: #1f77b4; background: #eef4fb; }
.role { font-weight: bold; font-size: 0.85em; } .turn-reward { margin-left: 0.6em; font-size: 0.85em; color: #2ca02c; }
.turn-text { white-space: pre-wrap; font-family: monospace; overflow-wrap: anywhere; }
"""

SCRIPT = """
const report = JSON.parse(document.getElementById("report-data").textContent);
const options = {displaylogo: false, responsive: true};
Promise.all(report.charts.map((chart, i) => Plotly.newPlot("chart-" + i, chart.traces, chart.layout, options)))
  .then(() => { document.body.dataset.rendered = "true"; })
  .catch((error) => { console.error("aligner report: a chart failed to draw:", error); });
"""


@functools.lru_cache(maxsize=1)
def plotly_js() -> str:
    """plotly.min.js as the `plotly` package ships it (read once per process)."""
    spec = importlib.util.find_spec("plotly")
    path = Path(spec.submodule_search_locations[0]) / "package_data" / "plotly.min.js" if spec else None
    if path is None or not path.is_file():
        raise ReportError("plotly.min.js not found (the report inlines it)", path or "the plotly package",
                          "install aligner's dependencies: pip install -e . (or pip install plotly)")
    return path.read_text(encoding="utf-8")


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def cell(value) -> str:
    """A table cell's text: numbers to 4 significant digits, missing values as a dash."""
    if value is None:
        return "&mdash;"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else esc(value)
    return esc(value)


def cut(value) -> str:
    text = "" if value is None else str(value)
    if len(text) > MAX_TEXT:
        text = f"{text[:MAX_TEXT]}\n[... {len(text) - MAX_TEXT} more characters]"
    return text


def text_cell(value) -> str:
    return f'<td class="text">{esc(cut(value))}</td>'


def turns_cell(row: dict) -> str:
    """A multi-turn episode's response as its turns: each assistant turn with the reward the environment gave
    for it, each observation message with its role; then why the environment failed, if it did."""
    items = []
    for turn in row["turns"] if isinstance(row["turns"], list) else []:
        turn = turn if isinstance(turn, dict) else {"role": "?", "text": turn}
        role = str(turn.get("role"))
        reward = turn.get("reward")
        badge = f'<span class="turn-reward">reward {cell(reward)}</span>' if isinstance(reward, (int, float)) else ""
        items.append(f'<li class="turn{" assistant" if role == "assistant" else ""}" data-role="{esc(role)}">'
                     f'<span class="role">{esc(role)}</span>{badge}'
                     f'<div class="turn-text">{esc(cut(turn.get("text")))}</div></li>')
    error = f'<div class="note">environment error: {esc(cut(row["error"]))}</div>' if row.get("error") else ""
    return f'<td class="episode"><ol class="turns">{"".join(items)}</ol>{error}</td>'


def table(header: list[str], rows: list[list[str]]) -> str:
    """header: escaped HTML; rows: lists of complete <td> elements."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join(f"<tr>{''.join(r)}</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def swatch(index: int) -> str:
    return f'<span class="swatch" style="background:{COLORS[index % len(COLORS)]}"></span>'


# ---- sections ----------------------------------------------------------------------------------------
def runs_section(runs: list[Run]) -> str:
    rows = [[f"<td>{swatch(i)}{esc(run.label)}</td>", f"<td>{esc(run.path)}</td>", f"<td>{esc(run.algorithm())}</td>",
             f"<td>{run.last_step()}</td>", f"<td>{len(run.rows)}</td>", f"<td>{esc(run.latest_checkpoint())}</td>"]
            for i, run in enumerate(runs)]
    return "<h2>Runs</h2>" + table(["run", "path", "algorithm", "last step", "logged steps", "latest checkpoint"], rows)


def charts_section(charts: list[dict]) -> str:
    if not charts:
        return '<h2>Curves</h2><p class="note">No metrics logged yet.</p>'
    divs = "".join(f'<div class="chart" id="chart-{i}" data-title="{esc(c["title"])}"></div>'
                   for i, c in enumerate(charts))
    return f'<h2>Curves</h2><div id="charts">{divs}</div>'


def config_section(runs: list[Run], diff: list[tuple[str, list]]) -> str:
    parts = ["<h2>Config differences</h2>"]
    if len(runs) == 1:
        parts.append('<p class="note">One run: nothing to compare (its whole config is below).</p>')
    elif not diff:
        parts.append('<p class="note">The runs\' configs are the same (run_dir aside).</p>')
    else:
        rows = [[f"<td>{esc(key)}</td>", *(f'<td class="text">{cell(v)}</td>' for v in values)] for key, values in diff]
        parts.append(table(["key", *(swatch(i) + esc(run.label) for i, run in enumerate(runs))], rows))
    for run in runs:
        text = run.config_text or "(no config.yaml in this run directory)"
        parts.append(f"<details><summary>config.yaml of {esc(run.label)}</summary><pre>{esc(text)}</pre></details>")
    return "".join(parts)


def rollouts_section(runs: list[Run]) -> str:
    shown = [run for run in runs if run.rollouts]
    if not shown:
        return ""
    parts = ["<h2>Rollout samples</h2>"]
    for run in shown:
        for step, rows in reversed(run.rollouts):
            fields = [f for f in ROLLOUT_FIELDS if any(f in r for r in rows)]
            body = [[turns_cell(r) if f == "response" and "turns" in r else
                     text_cell(r.get(f)) if f in ("prompt", "response") else f"<td>{cell(r.get(f))}</td>"
                     for f in fields] for r in rows]
            parts.append(f"<h3>{esc(run.label)}, step {step}</h3>" + table([esc(f) for f in fields], body))
    return "".join(parts)


# ---- charts as plotly.js JSON ---------------------------------------------------------------------------
def plotly_trace(trace: dict, kind: str) -> dict:
    out = {"type": "scatter", "x": trace["x"], "y": trace["y"], "name": trace["name"],
           "mode": "lines+markers" if len(trace["x"]) <= MARKERS_UP_TO else "lines", "marker": {"size": 5}}
    if kind == "stacked":
        out.update(stackgroup="phases", mode="lines")
    else:
        out["line"] = {"color": COLORS[trace["run"] % len(COLORS)], "dash": DASHES[trace["dash"] % len(DASHES)]}
    return out


def flat_range(chart: dict) -> list[float] | None:
    """A y range around a chart whose values are all equal (a constant learning rate): plotly.js would
    put it in [v - 1, v + 1], which flattens a value like 1e-5 onto zero."""
    values = {y for trace in chart["traces"] for y in trace["y"]}
    if len(values) != 1 or chart["kind"] == "stacked":
        return None
    value = values.pop()
    pad = abs(value) / 2 or 1.0
    return [value - pad, value + pad]


def plotly_chart(chart: dict) -> dict:
    yaxis = {"title": {"text": chart["ytitle"]}, "exponentformat": "e"}
    if (fixed := flat_range(chart)) is not None:
        yaxis["range"] = fixed
    layout = {"title": {"text": chart["title"]}, "margin": {"l": 70, "r": 20, "t": 40, "b": 40},
              "xaxis": {"title": {"text": "step"}}, "yaxis": yaxis,
              "hovermode": "x unified", "showlegend": True, "legend": {"font": {"size": 10}}}
    return {"traces": [plotly_trace(t, chart["kind"]) for t in chart["traces"]], "layout": layout}


def json_block(data: dict) -> str:
    """`data` as JSON that is safe inside a <script> element (no `<`, `>` or `&` in it)."""
    text = json.dumps(data, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(runs: list[Run], charts: list[dict], diff: list[tuple[str, list]]) -> str:
    title = "aligner report: " + ", ".join(run.label for run in runs)
    data = json_block({"charts": [plotly_chart(c) for c in charts]})
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{STYLE}</style>",
        f"<script>{plotly_js()}</script>", "</head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="note">Written {time.strftime("%Y-%m-%d %H:%M:%S")} by aligner report.</p>',
        runs_section(runs), charts_section(charts), config_section(runs, diff), rollouts_section(runs),
        f'<script type="application/json" id="report-data">{data}</script>',
        f"<script>{SCRIPT}</script>", "</body></html>", ""])
