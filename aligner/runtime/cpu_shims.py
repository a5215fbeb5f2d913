"""The megatron-core shims that make its CUDA-assuming code run on a CPU-only torch.

They are applied once per process by `apply()`, and only when CUDA is absent, so the GPU path is
untouched. We never edit megatron-core's files; every shim replaces a `torch.cuda` entry point, or one
megatron function, with its CPU meaning. What each works around (megatron-core 0.16.1):
* P1 `torch.cuda.current_device`: buffers allocated on `torch.cuda.current_device()`:
  `core/utils.py` GlobalMemoryBuffer.get_tensor (every DotProductAttention forward),
  `rotary_pos_embedding.py` RotaryEmbedding.get_emb, the tensor-parallel mappings, the pipeline's
  p2p receive buffers and the DDP gradient buffers (`param_and_grad_buffer.py`).
* P2 the CUDA RNG calls: `tensor_parallel/random.py` model_parallel_cuda_manual_seed ->
  CudaRNGStatesTracker.add, and `get_cuda_rng_tracker().fork()` in every DotProductAttention forward.
* P3 `torch.cuda.synchronize`: `pipeline_parallel/p2p_communication.py` after batched isend/irecv
  (batch_p2p_sync), and `dist_checkpointing/strategies/filesystem_async.py` preload_tensors.
* P4 `device="cuda"` literals and `.cuda()`: `pipeline_parallel/schedules.py` (total_num_tokens in
  every schedule), `models/common/language_module/language_module.py` (tied embeddings under PP),
  the optimizer and `optimizer/clip_grads.py` buffers, inference's text_generation_controller.
* P6 the optimizers dispatch on `t.type() == "torch.cuda.FloatTensor"`: `optimizer/distrib_optimizer.py`
  (wrapped parameter types), `optimizer/optimizer.py`, and the assert in `optimizer/clip_grads.py`
  clip_grad_by_total_norm_fp32.
* P7 `torch.cuda.Event`: `inference/text_generation_controllers/text_generation_controller.py` times
  each decode step with CUDA events.
* P8 `pin_memory=True`: `models/common/embeddings/rope_utils.py` get_pos_emb_on_this_cp_rank (CP > 1).
* P9 `torch.cuda.current_stream`: `param_and_grad_buffer.py` start_grad_sync (from megatron-core 0.19).
* P10 `transformer/torch_norm.py` WrappedTorchNorm asserts `not config.sequence_parallel`: only the
  apex/TE norms support sequence parallelism upstream.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch

_applied = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare CUDA ordinal


class _CudaLiteralsToCpu(torch.overrides.TorchFunctionMode):
    """P4/P6/P8: megatron hard-codes `device="cuda"`, `.cuda()`, `pin_memory=True` and dispatches
    the optimizers on `t.type() == "torch.cuda.FloatTensor"`; map all of these to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _WallClockEvent:
    """P7: stands in for torch.cuda.Event (inference timing); elapsed_time() in ms."""

    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


class _OrderedStream:
    """P9: on CPU every op is already ordered, so a stream is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return event or _WallClockEvent()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _sequence_parallel_torch_norm():
    """P10: the local spec's torch norm refuses sequence_parallel. A torch norm is correct under
    SP when its parameters are tagged `sequence_parallel`, because megatron's
    finalize_model_grads then all-reduces their grads over TP."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = build(cls, config, hidden_size, eps, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)


def apply() -> bool:
    """Apply every shim once in this process; a no-op when CUDA is available. Returns whether
    shims are active. The TorchFunctionMode is thread-local: threads that run megatron code
    must call `enter_thread()`."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    import megatron.core.tensor_parallel.random as tp_random

    torch.cuda.current_device = lambda: "cpu"  # P1: a str, so it is not read as an ordinal
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # P2
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.synchronize = lambda *a, **k: None  # P3
    torch.cuda.Event = _WallClockEvent  # P7
    torch.cuda.current_stream = lambda device=None: _OrderedStream()  # P9
    torch.cuda.Stream = _OrderedStream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    _sequence_parallel_torch_norm()  # P10
    enter_thread()
    _applied = True
    return True


def without_literal_rewrites():
    """A context in which torch calls bypass P4's mode: for code known to pass no CUDA literals,
    such as a model's forward on the local spec without context parallelism, where the mode's
    Python call on every torch op costs ~5-10% of the tiny model's forward. A no-op without shims."""
    return torch.DisableTorchFunction() if _applied else contextlib.nullcontext()


def enter_thread() -> None:
    """Push the literal-rewriting mode on the calling thread (idempotent per thread)."""
    if torch.cuda.is_available():
        return
    from torch.overrides import _get_current_function_mode_stack

    if not any(isinstance(m, _CudaLiteralsToCpu) for m in _get_current_function_mode_stack()):
        _CudaLiteralsToCpu().__enter__()
