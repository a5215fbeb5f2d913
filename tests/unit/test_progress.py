"""Progress of long commands (aligner.observe.progress) in this process, on a fake clock: a tqdm bar with ETA
on a terminal, periodic INFO summaries otherwise (or with logging.progress=false), nothing on ranks other than
the logging rank, durations that read short. `aligner generate` in batches: tests/e2e/test_progress.py."""
import io
import logging
import re

import pytest

from aligner.observe import progress as progress_module
from aligner.observe.progress import Progress, format_duration

ETA = re.compile(r"\d+/\d+ \[\d\d:\d\d<\d\d:\d\d")  # tqdm's "3/5 [00:01<00:02": elapsed < remaining
BAR_MARKS = ("\r", "%|")  # what only a tqdm bar writes (with ETA's "[00:01<00:02")


class Terminal(io.StringIO):
    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress_module, "_clock", fake)
    return fake


def summaries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress_module.__name__]


def run_steps(progress: Progress, steps: int, clock=None, seconds: float = 0.0) -> None:
    for step in range(steps):
        if clock is not None:
            clock.now += seconds
        progress.update({"loss": 2.0 - step / 10, "lr": 3e-4, "grad_norm": 1.0, "reward/mean": 0.25})
    progress.close()


def test_a_terminal_gets_a_bar_with_eta_and_the_watched_metrics(caplog):
    caplog.set_level(logging.INFO)
    stream = Terminal()
    run_steps(Progress(5, desc="train", stream=stream), 5)
    drawn = stream.getvalue()
    assert ETA.search(drawn) and "5/5" in drawn and "train" in drawn, drawn
    assert "loss=1.6" in drawn and "lr=0.0003" in drawn and "reward/mean=0.25" in drawn and "grad_norm" not in drawn
    assert summaries(caplog) == []


def test_piped_output_gets_periodic_summaries_and_the_last_one(caplog, clock):
    caplog.set_level(logging.INFO)
    stream = io.StringIO()
    run_steps(Progress(10, desc="train", stream=stream, summary_every_s=30), 10, clock, seconds=10.0)
    assert stream.getvalue() == ""  # nothing but log lines
    assert summaries(caplog) == [
        "train: step 3/10 (30%), 10.00 s/step, ETA 1m10s, loss 1.8 reward/mean 0.25 lr 0.0003",
        "train: step 6/10 (60%), 10.00 s/step, ETA 40s, loss 1.5 reward/mean 0.25 lr 0.0003",
        "train: step 9/10 (90%), 10.00 s/step, ETA 10s, loss 1.2 reward/mean 0.25 lr 0.0003",
        "train: step 10/10 (100%), 10.00 s/step, ETA 0s, loss 1.1 reward/mean 0.25 lr 0.0003",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_disabled_on_a_terminal_gives_summaries_not_a_bar(caplog, clock):
    """logging.progress=false: a resumed run (step 100 of 300) stopped early still logs where it stopped."""
    caplog.set_level(logging.INFO)
    stream = Terminal()
    progress = Progress(300, 100, enabled=False, stream=stream, summary_every_s=30)
    for _ in range(4):
        clock.now += 0.5
        progress.update(n=5)  # 4 updates of 5 units in 2 s: one summary, at close
    progress.close()
    progress.close()  # closing twice logs nothing more
    assert stream.getvalue() == ""
    assert summaries(caplog) == ["step 120/300 (40%), 10.0 step/s, ETA 18s"]


def test_a_failed_command_ends_with_its_error_not_a_summary(caplog, clock):
    caplog.set_level(logging.INFO)
    with pytest.raises(ValueError):
        with Progress(10, stream=io.StringIO(), summary_every_s=30) as progress:
            clock.now += 1
            progress.update()
            raise ValueError("a bad record")
    assert summaries(caplog) == []


def test_only_the_logging_rank_shows_progress(caplog):
    caplog.set_level(logging.INFO)
    for stream, enabled in ((Terminal(), True), (io.StringIO(), True), (Terminal(), False)):
        run_steps(Progress(4, enabled=enabled, silent=True, stream=stream, summary_every_s=0), 4)
        assert stream.getvalue() == ""
    assert summaries(caplog) == []


def test_durations_read_short():
    assert [format_duration(s) for s in (0, 45.4, 545, 3600 + 125)] == ["0s", "45s", "9m05s", "1h02m"]
