"""Rank entry points for the launcher tests."""
import os


def fail_on_rank_one(argv):
    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses: " + argv[0])


def write_rank(argv):
    with open(os.path.join(argv[0], f"rank{os.environ['RANK']}_of_{os.environ['WORLD_SIZE']}"), "w") as f:
        f.write(os.environ["MASTER_PORT"])
