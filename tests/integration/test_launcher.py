"""The embedded launcher starts N ranks with the torchrun variables and reports a failing rank."""
import pytest

from aligner.launch.local import RankFailed, launch


def test_ranks_get_torchrun_environment(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    launch("tests.launch_workers:write_rank", [str(tmp_path)], 3)
    assert list((tmp_path / "tmp").iterdir()) == []  # its own log directory is removed on success
    files = sorted(p.name for p in tmp_path.glob("rank*"))
    assert files == ["rank0_of_3", "rank1_of_3", "rank2_of_3"]
    assert len({p.read_text() for p in tmp_path.glob("rank*")}) == 1  # one master port


def test_failing_rank_traceback_is_reported(tmp_path):
    with pytest.raises(RankFailed) as err:
        launch("tests.launch_workers:fail_on_rank_one", ["boom"], 2, log_dir=tmp_path)
    message = str(err.value)
    assert message.startswith("rank 1 failed with exit code 1")
    assert "ValueError: rank one refuses: boom" in message
    assert "Traceback" in message


def test_a_rank_that_lost_a_rollout_worker_is_reported_not_the_peer_that_failed_after_it(tmp_path):
    """Rank 0's one line (exit 75, resume) is the report, although 75 is also a rank's code for a stop on request
    and rank 1 was the one that exited with a failure (its connection to rank 0 broke)."""
    with pytest.raises(RankFailed) as err:
        launch("tests.launch_workers:lose_a_worker_on_rank_zero", ["w0.log"], 2, log_dir=tmp_path)
    assert str(err.value).startswith("error: rollout worker 0 (TP rank 0) exited with code -9, log: w0.log"), err.value
    assert err.value.exit_code == 75
