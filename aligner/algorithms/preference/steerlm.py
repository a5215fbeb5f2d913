"""`aligner train steerlm`: SFT with each sample conditioned on its attribute values
(`aligner.data.steerlm`); the attribute names and scale are saved with every checkpoint so that
`aligner generate ... steerlm.attributes=name:value,...` builds the same condition.
`aligner label-attributes` labels SFT records with a regression reward model (`label_attributes`)."""
from __future__ import annotations

from pathlib import Path

import torch

from aligner.algorithms.shared import sft
from aligner.config import load_resolved
from aligner.data.steerlm import condition_ids, parse_attributes
from aligner.data.steerlm_labels import write_attribute_labels
from aligner.data.tokenizer import load_tokenizer
from aligner.models.checkpoint import read_metadata
from aligner.models.heads import last_token_scores
from aligner.launch.ranks import single_process
from aligner.models.scoring import forward_rows, load_scalar_model
from aligner.observe.progress import Progress
from aligner.runtime.distributed import device


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
        return score_in_batches(rm_checkpoint, sequences, batch_size)

    return write_attribute_labels(score, names, load_tokenizer(Path(rm_checkpoint) / "tokenizer"), data_path,
                                  out_path, scale, fmt)


def score_in_batches(rm_checkpoint, sequences: list[list[int]], batch_size: int) -> list[list[float]]:
    """`score_checkpoint(rm_checkpoint, sequences, micro_batch_size=batch_size)` one micro-batch per call,
    so that a progress bar follows it: every batch has batch_size rows (the last one padded) as wide as
    the longest sequence, as score_checkpoint's micro-batches are, so the scores are the same."""
    with single_process():
        model, outputs = load_scalar_model(rm_checkpoint)
        rows, width, height = [], max(map(len, sequences), default=1), min(batch_size, len(sequences))
        with Progress(len(sequences), unit="record", desc="label-attributes") as progress:
            for start in range(0, len(sequences), batch_size):
                batch = sequences[start:start + batch_size]
                tokens, lengths = _padded(batch, width, height)
                scores = forward_rows(model, tokens, lengths, batch_size, last_token_scores, (outputs,))
                rows += scores[:len(batch)].tolist()
                progress.update(n=len(batch))
        return rows


def _padded(sequences: list[list[int]], width: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] tokens (zeros after each sequence; rows past the sequences hold one 0 token) and lengths."""
    tokens = torch.zeros((rows, width), dtype=torch.int64)
    lengths = torch.ones(rows, dtype=torch.int64)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        lengths[row] = len(ids)
    return tokens.to(device()), lengths.to(device())
