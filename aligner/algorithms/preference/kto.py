"""`aligner train kto`: Kahneman-Tversky optimisation on unpaired desirable / undesirable samples
against a frozen reference, with the batch KL reference point (`preference/losses.py`)."""
from __future__ import annotations

from aligner.algorithms.preference.losses import KTO
from aligner.algorithms.preference.run import run_preference
from aligner.config import load_resolved


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "kto"))


def run(cfg) -> None:
    run_preference(cfg, KTO(cfg.kto), unpaired=True)
