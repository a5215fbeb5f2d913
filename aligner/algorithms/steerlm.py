"""`aligner train steerlm`: SFT with each sample conditioned on its attribute values
(`aligner.data.steerlm`); the attribute names and scale are saved with every checkpoint so that
`aligner generate ... steerlm.attributes=name:value,...` builds the same condition."""
from __future__ import annotations


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    from aligner.config import load_resolved

    run(load_resolved(argv[0], "steerlm"))


def run(cfg) -> None:
    from aligner.algorithms import sft
    from aligner.data.steerlm import condition_ids, parse_attributes

    names, scale = list(cfg.steerlm.attributes), cfg.steerlm.scale

    def condition(record, tokenizer):
        return condition_ids(tokenizer, parse_attributes(record, names, scale), names)

    sft.run(cfg, condition, extra_meta={"steerlm": {"attributes": names, "scale": scale}})
