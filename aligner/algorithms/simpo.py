"""`aligner train simpo`: simple preference optimisation (reference-free; `preference.py`)."""
from __future__ import annotations


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    from aligner.config import load_resolved

    run(load_resolved(argv[0], "simpo"))


def run(cfg) -> None:
    from aligner.algorithms.preference import SimPO, run as run_preference

    run_preference(cfg, SimPO(cfg.simpo))
