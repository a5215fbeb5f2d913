"""The one place that knows about optional, GPU-only packages.

`probe` tells *installed* from *importable*: GPU packages install on CPU hosts but fail at import
with OSError/RuntimeError (no libcuda), not ImportError. `require` raises an error that names the
extra to install. Nothing here fakes a missing package.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

from aligner.errors import UserError

# import name -> (pip extra of aligner, what it is for)
OPTIONAL = {
    "transformer_engine": ("te", "the Transformer-Engine layer spec, TE context-parallel attention and FP8"),
    "tensorrt_llm": ("trtllm", "TensorRT-LLM rollout generation (install from NVIDIA's index on a GPU image)"),
    "pytriton": ("serve", "the PyTriton reward/critic/verifier servers"),
    "tritonclient": ("serve", "the reward/critic/verifier client (installed with nvidia-pytriton)"),
    "modelopt": ("modelopt", "quantised export with NVIDIA ModelOpt (aligner export --quantize)"),
}


class MissingOptionalDependency(UserError, ImportError):
    pass


@dataclass(frozen=True)
class Availability:
    name: str
    installed: bool
    importable: bool
    reason: str | None


def probe(name: str) -> Availability:
    if importlib.util.find_spec(name) is None:
        return Availability(name, False, False, "not installed")
    try:
        importlib.import_module(name)
    except Exception as e:  # GPU packages raise OSError/RuntimeError without a driver
        return Availability(name, True, False, f"{type(e).__name__}: {e}")
    return Availability(name, True, True, None)


def require(name: str) -> ModuleType:
    found = probe(name)
    if found.importable:
        return importlib.import_module(name)
    raise unavailable(found)


def unavailable(found: Availability) -> MissingOptionalDependency:
    """The error for a package that `probe` found missing or unloadable."""
    extra, purpose = OPTIONAL[found.name]
    hint = (f"install it with `pip install 'aligner[{extra}]'`" if not found.installed
            else "it is installed but cannot load on this host (no GPU driver?)")
    return MissingOptionalDependency(f"{found.name} is needed for {purpose} ({found.reason})", f"import {found.name}",
                                     hint)


def report() -> dict[str, Availability]:
    return {name: probe(name) for name in OPTIONAL}
