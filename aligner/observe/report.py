"""`aligner report RUN_DIR [RUN_DIR ...] [--out FILE]`: one self-contained HTML report of training runs.

It reads what a run directory holds (`metrics.jsonl`, `config.yaml`, `rollouts/step_<N>.jsonl`,
`checkpoints/`) and draws one chart per metric family present in any run (runs overlaid, legend named
by run directory), a stacked chart of each run's `timing/*_s` phases, a table of the config keys whose
values differ between runs, and the latest rollout samples with their rewards, a multi-turn episode turn by
turn (its `turns`: the assistant's text with the environment's reward for it, the tool's output) (`report_html.py`
writes the page). `aligner train` writes `<run_dir>/report.html` at each checkpoint and at the end, so this is
cheap: plain Python over the JSON lines, no figure objects (a 150-step GRPO run takes tens of ms).

Plotting library: plotly.js, inlined once into the file from the `plotly` PyPI package (which ships
plotly.min.js; its Python figure API is not used: the traces are written as JSON here). Why:
* the file opens with no network access: the library is in the page, not fetched from a CDN;
* it is interactive where a static image is not: hover values, zoom, toggling runs in the legend;
* its `scatter` traces draw in SVG (no WebGL), so the report renders the same on a machine with no
  GPU and a test can count the drawn paths in the DOM;
* it stacks areas (`stackgroup`) for the timing breakdown, and is maintained and MIT-licensed.
The cost is ~5 MB of JavaScript per report file.

A run directory that cannot be read, or an --out that cannot be written, raises `ReportError` and a
command-line mistake `UsageError` (both `aligner.errors.UserError`s): aligner.cli prints one `error:`
line (exit code 1, or 2 for usage). aligner.observe is the lowest layer: nothing here imports torch or
another aligner package but aligner.errors.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import yaml  # PyYAML, which omegaconf requires; config.yaml is OmegaConf.save's plain YAML

from aligner.errors import ArgumentParser
from aligner.files import atomic_write
from aligner.observe import report_html
from aligner.observe.progress import Progress
from aligner.observe.report_run import ReportError, Run

ROLLOUT_STEPS = 3  # the latest rollouts/step_<N>.jsonl files shown per run
MAX_POINTS = 5000  # longer series are thinned (every k-th step) to keep the page light

# (chart title, metric names it takes); a name is matched with any `val/` prefix removed, so validation
# curves sit beside their training ones; the first family that takes a name gets it.
FAMILIES = [
    ("Loss", r"loss"),
    ("Reward", r"reward/.+"),
    ("KL", r"kl/.+|policy/approx_kl"),
    ("Accuracy", r"(.+/)?accuracy"),
    ("Response length", r"response_length/.+"),
    ("Entropy", r"entropy(/.+)?"),
    ("Clip fraction", r"(.+/)?clip_fraction"),
    ("Value loss", r"value/loss"),
    ("Grad norm", r"grad_norm"),
    ("Learning rate", r"lr"),
    ("Throughput", r"throughput/.+"),
]
VALIDATION = "Validation"  # the `val/*` metrics no family takes (e.g. val/<reward function>/mean)
# timing/<phase>_s phases left out of the stack: `step` is the whole step (the stack's top), `score` is the
# reward pool's own time (it overlaps the log-prob passes; `score_wait` is the loop's wait), `env` is the
# environments' time inside `generate` (or on separate rollout workers), and `*_server` phases are measured by a
# server while the trainer does something else.
UNSTACKED = re.compile(r"step|score|env|.+_server")


# ---- reading run directories --------------------------------------------------------------------------
def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a last line cut short (a run writing it right now) is left out."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ReportError(f"metrics line {number} is not JSON", f"{path}:{number}",
                              "fix or delete that line (each line is one JSON object)") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ReportError(f"metrics line {number} has no integer 'step'", f"{path}:{number}",
                              "each line must be a JSON object with a 'step' key, as aligner train writes it")
        rows.append(row)
    return rows


def read_config(run_dir: Path) -> tuple[dict, str]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}, ""
    text = path.read_text(errors="replace")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ReportError(f"config.yaml is not valid YAML ({e})", path, "fix the file or remove it") from None
    return (config if isinstance(config, dict) else {}), text


def rollout_step(path: Path) -> int | None:
    match = re.fullmatch(r"step_(\d+)\.jsonl", path.name)
    return int(match.group(1)) if match else None


def read_rollouts(run_dir: Path, steps: int = ROLLOUT_STEPS) -> list[tuple[int, list[dict]]]:
    files = sorted((s, p) for p in (run_dir / "rollouts").glob("step_*.jsonl") if (s := rollout_step(p)) is not None)
    latest = []
    for step, path in files[max(0, len(files) - steps):]:
        rows = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written, or not a sample: the report shows the others
        latest.append((step, [r for r in rows if isinstance(r, dict)]))
    return latest


def run_labels(paths: list[Path]) -> list[str]:
    """The shortest path tails (`grpo`, then `a/grpo`, ...) that tell the runs apart."""
    for depth in range(1, max(len(p.parts) for p in paths) + 1):
        tails = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(tails)) == len(tails):
            return tails
    return [str(p) for p in paths]  # the same directory given twice


def load_runs(run_dirs: list[str | Path], progress: bool = False) -> list[Run]:
    """The runs, read one by one (`progress`: with a progress bar on a terminal, for `aligner report`)."""
    paths = [Path(d).resolve() for d in run_dirs]
    for given, path in zip(run_dirs, paths):
        if not path.is_dir():
            raise ReportError("run directory not found", given,
                              "pass the run_dir of an 'aligner train' run (it holds metrics.jsonl)")
        if not (path / "metrics.jsonl").is_file():
            raise ReportError("no metrics.jsonl in the run directory", given,
                              "pass the run_dir of an 'aligner train' run that has logged a step")
    runs = []
    with Progress(len(paths), unit="run", desc="report", silent=not progress) as bar:
        for path, label in zip(paths, run_labels(paths)):
            config, text = read_config(path)
            runs.append(Run(path, label, read_metrics(path / "metrics.jsonl"), config, text, read_rollouts(path)))
            bar.update()
    return runs


# ---- what the charts show -----------------------------------------------------------------------------
def family_of(name: str) -> str | None:
    base = name.removeprefix("val/")
    for title, pattern in FAMILIES:
        if re.fullmatch(pattern, base):
            return title
    return VALIDATION if name.startswith("val/") else None


def families(runs: list[Run]) -> dict[str, list[str]]:
    """Each family present in any run -> its metric names (training ones first), in FAMILIES order."""
    found: dict[str, list[str]] = {}
    for run in runs:
        for name in run.metric_names():
            family = family_of(name)
            if family is not None and name not in found.setdefault(family, []) and run.series(name)[0]:
                found[family].append(name)
    order = [title for title, _ in FAMILIES] + [VALIDATION]
    return {title: sorted(found[title], key=lambda n: n.startswith("val/")) for title in order if found.get(title)}


def thin(xs: list, ys: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    """Every k-th point (and the last) of a series longer than `limit`."""
    if len(xs) <= limit:
        return xs, ys
    keep = list(range(0, len(xs), math.ceil(len(xs) / limit)))
    if keep[-1] != len(xs) - 1:
        keep.append(len(xs) - 1)
    return [xs[i] for i in keep], [ys[i] for i in keep]


def metric_chart(title: str, names: list[str], runs: list[Run]) -> dict:
    """One chart: a line per (run, metric); colour tells the run, dash the metric."""
    traces = []
    for r, run in enumerate(runs):
        for m, name in enumerate(names):
            steps, values = thin(*run.series(name))
            if steps:
                label = " ".join(part for part, many in ((run.label, len(runs) > 1), (name, len(names) > 1)) if many)
                traces.append({"x": steps, "y": values, "name": label or run.label, "run": r, "dash": m})
    return {"title": title, "kind": "lines", "ytitle": names[0] if len(names) == 1 else title, "traces": traces}


def timing_phases(run: Run) -> list[str]:
    """The run's stacked timing phases, in logging order (the loop's order)."""
    names = [n for n in run.metric_names() if re.fullmatch(r"timing/.+_s", n)]
    phases = [n for n in names if not UNSTACKED.fullmatch(n[len("timing/"):-2])]
    return phases or [n for n in names if n == "timing/step_s"]


def unaccounted(run: Run, phases: list[str]) -> tuple[list[int], list[float]]:
    """(steps, seconds) of each step's time that none of `phases` accounts for."""
    steps, seconds = run.series("timing/step_s")
    by_step = {row["step"]: row for row in run.rows}
    return steps, [max(0.0, total - sum(by_step[s].get(p, 0.0) for p in phases)) for s, total in zip(steps, seconds)]


def timing_chart(run: Run) -> dict | None:
    """A stacked area of a step's phases, plus `other`: the step's time no phase accounts for."""
    phases = timing_phases(run)
    traces = []
    for name in phases:
        steps, seconds = thin(*run.series(name))
        if steps:
            traces.append({"x": steps, "y": seconds, "name": name[len("timing/"):-len("_s")]})
    if not traces:
        return None
    if phases != ["timing/step_s"]:
        steps, seconds = thin(*unaccounted(run, phases))
        if any(v > 0 for v in seconds):
            traces.append({"x": steps, "y": seconds, "name": "other"})
    return {"title": f"Step time by phase: {run.label}", "kind": "stacked", "ytitle": "seconds", "traces": traces}


def charts(runs: list[Run]) -> list[dict]:
    """Every chart of the report, in order; charts with no data are left out."""
    drawn = [metric_chart(title, names, runs) for title, names in families(runs).items()]
    drawn += [c for run in runs if (c := timing_chart(run)) is not None]
    return [c for c in drawn if c["traces"]]


# ---- configs --------------------------------------------------------------------------------------------
def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"a.b.c": value as text (JSON but for strings)} of nested dicts; lists are values."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def config_diff(runs: list[Run]) -> list[tuple[str, list[str | None]]]:
    """(dotted key, each run's value or None where it has no such key) of the keys whose values differ;
    run_dir, which always does, is left out."""
    flat = [flatten(run.config) for run in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    rows = [(k, [f.get(k) for f in flat]) for k in keys if k != "run_dir"]
    return [(k, values) for k, values in rows if len(set(values)) > 1]


# ---- the report and the command -------------------------------------------------------------------------
def write_report(run_dirs: list[str | Path], out: str | Path, progress: bool = False) -> Path:
    """Write the HTML report of `run_dirs` to `out` (replaced whole, so an open copy never sees half a file)."""
    runs = load_runs(run_dirs, progress)
    page = report_html.render(runs, charts(runs), config_diff(runs))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out, encoding="utf-8") as f:
        f.write(page)
    return out


def main(argv: list[str]) -> int:
    """Write the report and print its path; a mistake raises a UserError for aligner.cli to print."""
    parser = ArgumentParser(prog="aligner report",
                            description="Write one self-contained HTML report of one or more training runs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (they hold metrics.jsonl)")
    parser.add_argument("--out", help="the HTML file to write (default: <first RUN_DIR>/report.html)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report.html"
    try:
        path = write_report(args.run_dirs, out, progress=True)
    except OSError as e:
        raise ReportError(e.strerror or str(e), e.filename or out,
                          "check that the run files are readable and --out is writable") from e
    print(f"wrote {path}")
    return 0
