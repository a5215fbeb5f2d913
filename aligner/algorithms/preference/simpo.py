"""`aligner train simpo`: simple preference optimisation (reference-free; `preference/losses.py`)."""
from __future__ import annotations

from aligner.algorithms.preference.losses import SimPO
from aligner.algorithms.preference.run import run_preference
from aligner.config import load_resolved


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "simpo"))


def run(cfg) -> None:
    run_preference(cfg, SimPO(cfg.simpo))
