"""Process logging: our INFO lines on rank 0, warnings elsewhere, and the run's log files.

A user cannot act on a dependency's warnings (deprecations, CPU fallbacks), so Python warnings go to
`<run_dir>/logs/warnings.log` (a temp file before the run directory is known), never to the terminal;
megatron's per-bucket parameter listings and its known CPU fallback warnings are dropped. Rank 0 also
writes its log lines to `<run_dir>/logs/rank_0.log` (the launcher already sends other ranks' output to
`rank_<r>.log`), so that `aligner doctor` can read them."""
from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path

_EXPECTED_WARNINGS = (
    "Apex is not installed", "Transformer Engine and Apex are not installed", "Falling back to local implementations",
    "torch.jit.script_method", "When using async grad allreduce", "reduce_scatter_tensor is deprecated",
    "full scope is deprecated", "TorchFunctionMode",
)
LOG_DIR_VARIABLE = "ALIGNER_LOG_DIR"  # the run's logs/ directory, inherited by its ranks
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def silence_expected_warnings() -> None:
    """Call before importing megatron: these fire at import time on every CPU host."""
    for text in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}.*")


def _replace_handler(logger: logging.Logger, handler: logging.Handler, kind: str) -> None:
    for old in [h for h in logger.handlers if getattr(h, "aligner_kind", None) == kind]:
        logger.removeHandler(old)
        old.close()
    handler.aligner_kind = kind
    logger.addHandler(handler)


def send_warnings_to_log(log_dir: str | Path | None = None) -> Path:
    """Python warnings to `<log_dir>/warnings.log` (default: the run's, else a temp file); returns the file.
    The file is created only when a warning comes."""
    log_dir = log_dir or os.environ.get(LOG_DIR_VARIABLE)
    path = (Path(log_dir) / "warnings.log" if log_dir
            else Path(tempfile.gettempdir()) / f"aligner-{os.getpid()}-warnings.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.captureWarnings(True)
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.propagate = False
    _replace_handler(py_warnings, handler, "warnings")
    return path


def use_run_log_dir(log_dir: str | Path) -> None:
    """The run directory is known: its logs/ holds warnings, and ranks started from here inherit it."""
    os.environ[LOG_DIR_VARIABLE] = str(log_dir)
    send_warnings_to_log(log_dir)


def configure_logging(rank: int) -> None:
    silence_expected_warnings()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True, format=FORMAT)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    log_dir = os.environ.get(LOG_DIR_VARIABLE)
    send_warnings_to_log(log_dir)
    if rank == 0 and log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(Path(log_dir) / "rank_0.log")
        handler.setFormatter(logging.Formatter(FORMAT))
        _replace_handler(logging.getLogger(), handler, "rank_log")
