"""megatron's jit_fuser is a no-op on a host without CUDA once `aligner` is imported (aligner/megatron_jit.py):
megatron's import then leaves torch's Dynamo and Inductor unimported."""
import subprocess
import sys

import torch

PROBE = """
import sys
import aligner
import megatron.core.models.gpt.gpt_model, megatron.core.pipeline_parallel, megatron.core.optimizer
import megatron.core.jit as jit
from megatron.core.transformer.utils import gelu_impl
print(int("torch._dynamo" in sys.modules), int(jit.jit_fuser is jit.noop_decorator), type(gelu_impl).__name__)
"""


def test_megatron_imports_without_dynamo_and_its_fused_helpers_run_eagerly():
    if torch.cuda.is_available():
        return  # with CUDA megatron keeps torch.compile as its fuser; nothing to check here
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["0", "1", "function"]


def test_installing_the_hook_after_megatron_is_imported_adds_nothing():
    import megatron.core.jit  # noqa: F401

    from aligner import megatron_jit

    before = list(sys.meta_path)
    megatron_jit.install()
    assert sys.meta_path == before
