"""`aligner doctor RUN_DIR` from outside: unreadable run directories give one error line and exit 1, a cut
last line is skipped, and a real short GRPO run made here through the CLI shows nothing. The rules on synthetic
runs: tests/unit/test_doctor_rules.py."""
from __future__ import annotations

import pytest

from aligner.observe import doctor
from tests.conftest import read_metrics, run_cli
from tests.e2e.test_rl_loop import grpo_args
from tests.unit.test_doctor_rules import STEPS, healthy_rows, write_run


def assert_one_error_line(result, *parts: str) -> None:
    """`aligner doctor` could not read a run: exit code 1, one `error:` line naming `parts`, no traceback."""
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and all(part in result.stderr for part in parts), result.stderr


def test_unreadable_run_dirs_give_one_error_line_and_exit_1(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_error_line(run_cli("doctor", str(tmp_path / "missing")), "no such run directory", str(tmp_path / "missing"))
    assert_one_error_line(run_cli("doctor", str(empty)), "no metrics.jsonl", str(empty / "metrics.jsonl"))
    broken = write_run(tmp_path / "broken", healthy_rows())
    lines = (broken / "metrics.jsonl").read_text().splitlines()
    (broken / "metrics.jsonl").write_text("\n".join(lines[:3] + ['{"step": 3, "lo'] + lines[3:]) + "\n")
    assert_one_error_line(run_cli("doctor", str(broken)), "line 4 is not JSON", "metrics.jsonl:4")
    (broken / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (broken / "config.yaml").write_text("trainer: [unclosed\n")
    assert_one_error_line(run_cli("doctor", str(broken)), "config.yaml is not valid YAML", str(broken / "config.yaml"))


def test_a_cut_last_line_is_skipped_and_readable_runs_are_reported_before_the_error(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", healthy_rows())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 31, "lo')  # died mid-write
    assert doctor.main([str(run_dir)]) == 0 and "no known failure symptoms" in capsys.readouterr().out
    result = run_cli("doctor", str(run_dir), str(tmp_path / "missing"))
    assert f"{run_dir}:\n  no known failure symptoms in {STEPS} steps" in result.stdout
    assert_one_error_line(result, str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def real_run(tiny_assets, rl_assets, tmp_path_factory):
    """12 GRPO steps through the CLI, with the refit check on; its output saved in the run directory, as a
    user's `2> RUN_DIR/train.log` would."""
    run_dir = tmp_path_factory.mktemp("doctor") / "grpo"
    result = run_cli(*grpo_args(tiny_assets, rl_assets, run_dir, "trainer.max_steps=12", "trainer.global_batch_size=8",
                                "optim.lr=1e-4", "optim.min_lr=1e-4", "generation.check_refit=true"))
    assert result.returncode == 0, result.stderr[-4000:]
    (run_dir / "train.log").write_text(result.stderr)
    return run_dir


def test_a_real_healthy_run_shows_nothing(real_run, capsys):
    run = doctor.load_run(real_run)
    assert len(read_metrics(real_run)) == 12 and run.logs and run.checkpoints == [12]
    assert doctor.unchecked(run) == {}  # every rule had its metrics, enough steps, the config and the logs
    assert doctor.diagnose(real_run) == []
    assert doctor.main([str(real_run)]) == 0
    assert "no known failure symptoms in 12 steps" in capsys.readouterr().out
