"""The megatron-core shims that make its CUDA-assuming code run on a CPU-only torch.

They are applied once per process by `apply()`, and only when CUDA is absent, so the GPU path is
untouched. We never edit megatron-core's files; every shim replaces a `torch.cuda` entry point, or one
megatron function, with its CPU meaning. What each works around, in megatron-core 0.16.1 (paths under
`megatron/core/`; upstream assumes one CUDA device per rank and NCCL, whose collectives need CUDA tensors):
* P1 `torch.cuda.current_device()` as the device of new buffers: `utils.py` GlobalMemoryBuffer.get_tensor
  (the attention's scratch buffer), `models/common/embeddings/rotary_pos_embedding.py`
  RotaryEmbedding.__init__ and get_emb (the inverse frequencies), `tensor_parallel/mappings.py`
  _gather_along_first_dim, _gather_along_last_dim and _reduce_scatter_along_first_dim (collective
  outputs), `pipeline_parallel/p2p_communication.py` P2PCommunicator._communicate_shapes and
  _communicate (receive buffers) and `distributed/param_and_grad_buffer.py` _ParamAndGradBuffer.__init__
  (the DDP grad buffers).
* P2 the CUDA RNG: `tensor_parallel/random.py` model_parallel_cuda_manual_seed calls
  `torch.cuda.manual_seed` and CudaRNGStatesTracker.add, which saves and restores the CUDA generator
  (`torch.cuda.get_rng_state`, _get_cuda_rng_state / _set_cuda_rng_state); CudaRNGStatesTracker.fork
  swaps it around every tensor-parallel region (`transformer/dot_product_attention.py`
  DotProductAttention.forward). Upstream keeps one CUDA generator stream per TP rank so that dropout
  inside TP regions differs across TP ranks while the default stream stays identical. Here the
  tracker's states are CPU generator states, so a checkpoint files them under "cpu" (runtime/seeding.py).
* P3 `torch.cuda.synchronize()`: `pipeline_parallel/p2p_communication.py` P2PCommunicator._communicate_shapes
  and _communicate (with batch_p2p_sync: "to protect against race condition when using
  batch_isend_irecv()"), and `dist_checkpointing/strategies/filesystem_async.py`
  FileSystemWriterAsync.preload_tensors (waits for its non-blocking device-to-host copies).
* P4 `device="cuda"` literals and `.cuda()`: `pipeline_parallel/schedules.py` forward_backward_no_pipelining,
  forward_backward_pipelining_with_interleaving / _without_interleaving (`total_num_tokens`, all-reduced
  for per-token losses), `models/common/language_module/language_module.py`
  LanguageModule.setup_embeddings_and_output_layer (tied embeddings under PP, all-reduced between the
  first and last stage), `optimizer/clip_grads.py` get_grad_norm_fp32, clip_grad_by_total_norm_fp32 and
  count_zeros_fp32 (norms all-reduced over the model-parallel group), `optimizer/optimizer.py`
  MixedPrecisionOptimizer.__init__ and FP32Optimizer.__init__ (found-inf flag and loss scale), and
  `inference/text_generation_controllers/text_generation_controller.py`
  TextGenerationController.generate_all_output_tokens_static_batch.
* P6 the optimizers dispatch on `t.type() == "torch.cuda.FloatTensor"` (and the Half / BFloat16 names)
  to tell fp32 parameters from fp16/bf16 ones: `optimizer/distrib_optimizer.py`
  DistributedOptimizer._build_model_and_main_param_groups and __init__, `optimizer/optimizer.py`
  Float16OptimizerWithFloat16Params.__init__, and the assert in `optimizer/clip_grads.py`
  clip_grad_by_total_norm_fp32.
* P7 `torch.cuda.Event(enable_timing=True)`: `inference/text_generation_controllers/text_generation_controller.py`
  TextGenerationController.generate_all_output_tokens_static_batch times prefill and decode with it.
* P8 `pin_memory=True`: `models/common/embeddings/rope_utils.py` get_pos_emb_on_this_cp_rank (CP > 1)
  pins the index tensor for an asynchronous host-to-device copy; pinning needs CUDA.
* P9 CUDA streams: `distributed/distributed_data_parallel.py` DistributedDataParallel.__init__ creates a
  communication stream (`torch.cuda.Stream`), and `distributed/param_and_grad_buffer.py`
  _ParamAndGradBucketGroup.start_grad_sync reduces gradients under `torch.cuda.stream(...)` on it, to
  overlap the reduction with compute, when the distributed optimizer has several instances
  (num_distributed_optimizer_instances > 1); `torch.cuda.current_stream` is replaced with them. On CPU
  every op is already ordered.
Sequence parallelism on the local spec (megatron's torch norm refuses it) needs no shim: it is the same
on every device, so the local spec's norms take it themselves (`models/gpt.py` SequenceParallelTorchNorm).
"""
from __future__ import annotations

import contextlib
import time

import megatron.core.tensor_parallel.random as tp_random
import torch
from torch.overrides import _get_current_function_mode_stack

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


def apply() -> bool:
    """Apply every shim once in this process; a no-op when CUDA is available. Returns whether
    shims are active. The TorchFunctionMode is thread-local: threads that run megatron code
    must call `enter_thread()`."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
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
    if not any(isinstance(m, _CudaLiteralsToCpu) for m in _get_current_function_mode_stack()):
        _CudaLiteralsToCpu().__enter__()
