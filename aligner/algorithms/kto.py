"""`aligner train kto`: Kahneman-Tversky optimisation on unpaired desirable / undesirable samples
against a frozen reference, with the batch KL reference point (`preference.py`)."""
from __future__ import annotations


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    from aligner.config import load_resolved

    run(load_resolved(argv[0], "kto"))


def run(cfg) -> None:
    from aligner.algorithms.preference import KTO, run as run_preference

    run_preference(cfg, KTO(cfg.kto), unpaired=True)
