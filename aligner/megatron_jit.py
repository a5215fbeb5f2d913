"""megatron-core's `jit_fuser` as a no-op on hosts without CUDA, set before megatron's modules use it.

megatron decorates a few element-wise helpers (gelu variants, MoE routing, qk L2 norm, gated attention) with
`jit_fuser`, which is `torch.compile` on torch >= 2.2. Decorating already imports torch's Dynamo and
Inductor: about 1.5 s of every process's megatron import on the 2-core CPU, for functions that aligner's
CPU configurations never call (every fusion is off there, see models.gpt.transformer_config). megatron's own
switch, `megatron.core.jit.disable_jit_fuser()`, only helps before the decorating modules import
`jit_fuser`, and importing `megatron.core.jit` runs `megatron.core`'s `__init__`, which imports them. So an
import hook calls it as soon as `megatron.core.jit` has run. With CUDA nothing changes.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_MODULE = "megatron.core.jit"


class _DisableJitFuserOnCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one use; the real finders locate the module
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch  # not at module level: every `aligner` command imports this module, --help too

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Add the hook, unless megatron's jit module is imported already (then it is too late) or the hook is in."""
    if _MODULE not in sys.modules and not any(isinstance(f, _DisableJitFuserOnCpu) for f in sys.meta_path):
        sys.meta_path.insert(0, _DisableJitFuserOnCpu())
