"""Progress of a long command (train, generate, convert, label-attributes, report) on the logging rank.

On a terminal: a tqdm bar with ETA on stderr. Otherwise (output piped to a file or a CI log, or
`logging.progress=false`): a one-line INFO summary through `logging` at most every
`summary_every_s` seconds, and always at the end, so that logs still say how far a run is, e.g.
    train: step 40/300 (13%), 2.10 s/step, ETA 9m06s, loss 1.234 lr 0.0003
Every rank but the logging rank (global rank 0) passes `silent=True` and shows nothing.
No torch here: aligner.observe is the lowest layer.
"""
from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger(__name__)

SHOWN_METRICS = ("loss", "reward/mean", "kl/mean", "lr")  # the values a user watches, when a step has them
SUMMARY_EVERY_S = 30.0
_clock = time.monotonic  # tests replace it


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def format_duration(seconds: float) -> str:
    """9m06s, 1h02m, 45s: short enough for one log line."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def shown_metrics(metrics: dict | None) -> dict[str, str]:
    """{name: value as 4 significant digits} of SHOWN_METRICS present in `metrics` (floats or 0-d tensors)."""
    shown = {}
    for key in SHOWN_METRICS:
        try:
            shown[key] = f"{float(metrics[key]):.4g}"
        except (KeyError, TypeError, ValueError):
            continue
    return shown


def _summary_logger() -> logging.Logger:
    """Our logger; when nothing has configured logging in this process (generate, convert and
    label-attributes do not), a child of it that writes to stderr itself, so the summaries still show."""
    if logging.getLogger().handlers:
        return log
    fallback = logging.getLogger(f"{__name__}.stderr")
    if not fallback.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        fallback.addHandler(handler)
        fallback.setLevel(logging.INFO)
        fallback.propagate = False
    return fallback


class Progress:
    """`total` units of work, `initial` of them already done (a resumed run). `update(metrics, n)` after
    each unit (or n units); `close()` at the end, also on an early exit. Usable as a context manager."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, *, silent: bool = False,
                 unit: str = "step", desc: str | None = None, summary_every_s: float = SUMMARY_EVERY_S,
                 stream=None):
        self.total, self.done, self.unit, self.desc = int(total), int(initial), unit, desc
        self.summary_every_s = summary_every_s
        self.metrics: dict[str, str] = {}
        self.started = self.last_summary = _clock()
        self.started_at, self.summarised_at = self.done, self.done
        stream = sys.stderr if stream is None else stream
        self.bar = None
        self.summaries = not silent
        if not silent and enabled and is_terminal(stream):
            self.bar = tqdm(total=self.total, initial=self.done, unit=unit, desc=desc, file=stream,
                            dynamic_ncols=True)
            self.summaries = False

    def update(self, metrics: dict | None = None, n: int = 1) -> None:
        self.done += n
        self.metrics = shown_metrics(metrics) or self.metrics
        if self.bar is not None:
            self.bar.set_postfix(self.metrics, refresh=False)
            self.bar.update(n)
        elif self.summaries and self.summarised_at != self.done and (
                self.done >= self.total or _clock() - self.last_summary >= self.summary_every_s):
            self._summarise()

    def close(self, summary: bool = True) -> None:
        """Ends the bar; or logs the last state unless it was just logged (or `summary` is False)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.summaries and summary and self.summarised_at != self.done:
            self._summarise()
        self.summaries = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(summary=exc_type is None)  # a failed command ends with its one `error:` line

    def summary(self) -> str:
        """`desc: unit done/total (pct), pace, ETA ..., metrics`; pace and ETA once a unit is done here."""
        parts = [f"{self.unit} {self.done}/{self.total}"
                 + (f" ({100 * self.done // self.total}%)" if self.total else "")]
        done_here, elapsed = self.done - self.started_at, _clock() - self.started
        if done_here > 0:
            per_unit = elapsed / done_here
            parts.append(f"{per_unit:.2f} s/{self.unit}" if per_unit >= 1 or per_unit == 0
                         else f"{1 / per_unit:.1f} {self.unit}/s")
            parts.append(f"ETA {format_duration(per_unit * max(0, self.total - self.done))}")
        if self.metrics:
            parts.append(" ".join(f"{k} {v}" for k, v in self.metrics.items()))
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)

    def _summarise(self) -> None:
        _summary_logger().info("%s", self.summary())
        self.last_summary, self.summarised_at = _clock(), self.done
