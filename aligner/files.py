"""Writing a file or a directory so that its final path only ever holds a complete one: write to
`<path>.partial`, then rename it onto `path` (`os.replace`, atomic on one filesystem). A reader, a
resumed run or `aligner doctor` then sees the old version or the new one, never half of one.

Imports nothing of aligner's: every layer may use it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def partial_path(path) -> Path:
    """Where `path` is written before it is renamed into place: `<path>.partial`."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


@contextlib.contextmanager
def atomic_write(path, mode: str = "w", **open_args):
    """`open(<path>.partial, mode)` for the block; renamed onto `path` when the block ends without an error."""
    partial = partial_path(path)
    with open(partial, mode, **open_args) as f:
        yield f
    os.replace(partial, path)


@contextlib.contextmanager
def atomic_directory(path):
    """A fresh, empty `<path>.partial` directory (parents made) for the block to fill; renamed onto `path`
    when the block ends without an error. An existing `path` must be an empty directory (it is replaced)."""
    path, partial = Path(path), partial_path(path)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    yield partial
    if path.exists():
        path.rmdir()
    os.replace(partial, path)
