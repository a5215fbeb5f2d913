"""`aligner train dpo`: DPO and its variants (sigmoid, robust, hinge, IPO, RPO) against a frozen
reference; the machinery is in `preference.py`, the losses in `functional.py`."""
from __future__ import annotations


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    from aligner.config import load_resolved

    run(load_resolved(argv[0], "dpo"))


def run(cfg) -> None:
    from aligner.algorithms.preference import DPO, run as run_preference

    run_preference(cfg, DPO(cfg.dpo))
