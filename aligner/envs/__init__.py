"""Multi-turn environments and tools for RL rollouts (`env.*`): the contract (`Environment`, base.py), the
built-ins (`calculator`, `python`: tools.py), resolution of `env.name`, the worker processes that run them
(pool.py) and the episode runner that interleaves them with the engine (episodes.py).

This module and base/tools/pool import no torch: the CLI process resolves `env.name` before launch."""
from __future__ import annotations

import importlib

from aligner.envs.base import Environment, Observation
from aligner.envs.tools import Calculator, PythonTool

__all__ = ["ENVIRONMENTS", "Environment", "Observation", "resolve_environment"]

ENVIRONMENTS: dict[str, type] = {"calculator": Calculator, "python": PythonTool}


def resolve_environment(name: str) -> type:
    """The class of `env.name`: a builtin, or `package.module:Class` (imported). Raises ValueError naming the
    name: unknown, not importable, or not a class with callable `reset` and `step`."""
    builtins = ", ".join(ENVIRONMENTS)
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, colon, attribute = str(name).partition(":")
    if not (colon and module and attribute):
        raise ValueError(f"unknown environment {name!r}: expected a builtin ({builtins}) or package.module:Class")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raises on import
        raise ValueError(f"environment {name!r} cannot be loaded ({type(e).__name__}: {e}); expected a builtin "
                         f"({builtins}) or an importable package.module:Class") from e
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        what = f"a {type(cls).__name__}, not a class" if not isinstance(cls, type) else \
            f"a class without {' and '.join(missing)}"
        raise ValueError(f"environment {name!r} is {what}; an environment class has reset(record) and "
                         f"step(action_text) (aligner.envs.Environment)")
    return cls
