"""`aligner train steerlm`: SFT with each sample conditioned on its attribute values
(`aligner.data.steerlm`); the attribute names and scale are saved with every checkpoint so that
`aligner generate ... steerlm.attributes=name:value,...` builds the same condition.
`aligner label-attributes` labels SFT records with a regression reward model (`label_attributes`)."""
from __future__ import annotations

from pathlib import Path

from aligner.algorithms import sft
from aligner.config import load_resolved
from aligner.data.steerlm import condition_ids, parse_attributes, write_attribute_labels
from aligner.data.tokenizer import load_tokenizer
from aligner.models.checkpoint import read_metadata
from aligner.models.scoring import score_checkpoint


def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "steerlm"))


def run(cfg) -> None:
    names, scale = list(cfg.steerlm.attributes), cfg.steerlm.scale

    def condition(record, tokenizer):
        return condition_ids(tokenizer, parse_attributes(record, names, scale), names)

    sft.run(cfg, condition, extra_meta={"steerlm": {"attributes": names, "scale": scale}})


def label_attributes(rm_checkpoint, data_path, out_path, scale: int = 4, fmt: str = "auto",
                     batch_size: int = 16) -> Path:
    """`write_attribute_labels` with a regression reward-model checkpoint run in this process."""
    head = read_metadata(rm_checkpoint).get("scalar_head") or {}
    names = head.get("attributes")
    if not names:
        raise ValueError(f"{rm_checkpoint} is not a regression reward model with named attributes "
                         f"(train one with rm.loss=regression rm.attributes=[...])")

    def score(sequences):
        return score_checkpoint(rm_checkpoint, sequences, micro_batch_size=batch_size).tolist()

    return write_attribute_labels(score, names, load_tokenizer(Path(rm_checkpoint) / "tokenizer"), data_path,
                                  out_path, scale, fmt)
