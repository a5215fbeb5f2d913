"""Rank entry points for the launcher tests."""
import os


def fail_on_rank_one(argv):
    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses: " + argv[0])


def write_rank(argv):
    with open(os.path.join(argv[0], f"rank{os.environ['RANK']}_of_{os.environ['WORLD_SIZE']}"), "w") as f:
        f.write(os.environ["MASTER_PORT"])


def lose_a_worker_on_rank_zero(argv):
    """Rank 0 loses a rollout worker (a user's error that exits 75); rank 1 then fails as its peer is gone."""
    import time

    from aligner.generation.workers import RolloutWorkerLost

    if os.environ["RANK"] == "0":
        raise RolloutWorkerLost("rollout worker 0 (TP rank 0) exited with code -9", "log: " + argv[0])
    time.sleep(0.5)
    raise RuntimeError("Connection closed by peer")
