"""`aligner train orpo`: odds-ratio preference optimisation (reference-free; `preference.py`)."""
from __future__ import annotations


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    from aligner.config import load_resolved

    run(load_resolved(argv[0], "orpo"))


def run(cfg) -> None:
    from aligner.algorithms.preference import ORPO, run as run_preference

    run_preference(cfg, ORPO(cfg.orpo))
