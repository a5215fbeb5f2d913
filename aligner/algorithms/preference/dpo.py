"""`aligner train dpo`: DPO and its variants (sigmoid, robust, hinge, IPO, RPO) against a frozen
reference; the machinery is in `shared/sequence_trainer.py`, the losses in `preference/losses.py` and `preference/maths.py`."""
from __future__ import annotations

from aligner.algorithms.preference.losses import DPO
from aligner.algorithms.preference.run import run_preference
from aligner.config import load_resolved


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "dpo"))


def run(cfg) -> None:
    run_preference(cfg, DPO(cfg.dpo))
