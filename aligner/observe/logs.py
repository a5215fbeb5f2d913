"""Process logging: our INFO lines on rank 0, warnings elsewhere, and megatron's per-bucket
parameter listings and known CPU fallback warnings kept out of the way."""
from __future__ import annotations

import logging
import warnings

_EXPECTED_WARNINGS = (
    "Apex is not installed", "Transformer Engine and Apex are not installed", "Falling back to local implementations",
    "torch.jit.script_method", "When using async grad allreduce", "reduce_scatter_tensor is deprecated",
    "full scope is deprecated", "TorchFunctionMode",
)


def silence_expected_warnings() -> None:
    """Call before importing megatron: these fire at import time on every CPU host."""
    for text in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}.*")


def configure_logging(rank: int) -> None:
    silence_expected_warnings()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
