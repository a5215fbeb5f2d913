"""TensorRT-LLM rollout backend: a thin adapter (GPU hosts only; optional extra `aligner[trtllm]`).

Target: TensorRT-LLM 1.2.x, PyTorch backend, `tensorrt_llm.LLM` with `orchestrator_type="ray"` and
the RL worker extension `tensorrt_llm.llmapi.rlhf_utils.WorkerExtension`, whose RPCs we use:
  * `update_weights(ipc_handles)` with {device_uuid: [(hf_name, cuda_ipc_handle), ...]} once per
    bucket of our HF-named weight stream, then `update_weights(None)` to finalise the reload;
  * `sleep(tags)` / `wakeup(tags)` with the memory tags "model" and "kv_cache".
The TensorRT *engine* refit path is not used: it was removed upstream (PyTorch is TRT-LLM's only
backend on main).

What was exercised where: the pure functions here (`sampling_kwargs`, `rollout_from_outputs`) and
`send_weight_stream`'s collective protocol (with a stand-in for the IPC handle) run in the CPU test
suite. Starting the engine, generating and `update_weights` were NOT exercised in this project's
workplace: TensorRT-LLM cannot be installed on the CPU CI machines (PyPI only hosts a stub) nor
carried to the lent GPU machine. Treat this backend as untested until it has run on a GPU image with
TensorRT-LLM, and compare its rollouts with the Megatron engine there (`mismatch/*` metrics).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from aligner.generation.types import (STOP_EOS, STOP_LENGTH, STOP_STRING, STOP_TOKEN, Rollout, SamplingParams,
                                      WeightStream)
from aligner.runtime import collectives
from aligner.runtime.optional import require

# tensorrt_llm is imported inside the engine's methods: it is an optional dependency (GPU images only).

MEMORY_TAGS = ("model", "kv_cache")


def sampling_kwargs(params: SamplingParams, seed: int, eos_id: Optional[int]) -> dict:
    """Our SamplingParams as keyword arguments of `tensorrt_llm.SamplingParams` (one-to-one).

    Greedy maps to top_k=1 at temperature 1, so the returned log-probs are those of the model's own
    distribution, the convention of `aligner.generation.types`."""
    kwargs = dict(max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens, seed=int(seed),
                  end_id=eos_id, stop_token_ids=list(params.stop_token_ids) or None,
                  stop=list(params.stop_strings) or None, include_stop_str_in_output=True, logprobs=1)
    if params.is_greedy:
        kwargs.update(temperature=1.0, top_k=1, top_p=1.0)
    else:
        kwargs.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    return kwargs


def _chosen_logprob(entry, token: int) -> float:
    """TRT-LLM reports a float, or a {token: Logprob | float} dict of the top candidates."""
    if isinstance(entry, Mapping):
        value = entry[token]
        return float(getattr(value, "logprob", value))
    return float(entry)


def rollout_from_outputs(outputs: Sequence, prompts: list[list[int]], params: SamplingParams,
                         eos_id: Optional[int], pad_id: int) -> Rollout:
    """`LLM.generate` results (one RequestOutput per prompt, first completion used) -> Rollout."""
    responses, logprobs, reasons = [], [], []
    for out in outputs:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        responses.append(ids)
        logprobs.append([_chosen_logprob(e, t) for e, t in zip(completion.logprobs or [], ids)] or [0.0] * len(ids))
        last = ids[-1] if ids else None
        if completion.finish_reason == "length":
            reasons.append(STOP_LENGTH)
        elif last is not None and last == eos_id:
            reasons.append(STOP_EOS)
        elif last is not None and last in params.stop_token_ids:
            reasons.append(STOP_TOKEN)
        else:
            reasons.append(STOP_STRING)
    width = max([len(r) for r in responses] + [1])
    ids = torch.full((len(responses), width), pad_id, dtype=torch.long)
    lps = torch.zeros(len(responses), width)
    for i, (r, lp) in enumerate(zip(responses, logprobs)):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        lps[i, :len(lp)] = torch.tensor(lp)
    return Rollout(prompt_ids=prompts, response_ids=ids, response_lengths=torch.tensor([len(r) for r in responses]),
                   logprobs=lps, is_end=torch.tensor([r != STOP_LENGTH for r in reasons]), stop_reason=reasons,
                   pad_id=pad_id)


def send_weight_stream(stream: WeightStream, device_uuid: str, device, to_handle, update) -> int:
    """Collective over every rank (a world of one without torch.distributed): `stream` into the engine
    through IPC handles, a bucket at a time; returns the number of buckets.

    Every rank iterates its own stream (all of the same length, some buckets empty on some ranks) and
    makes exactly one object all-gather per bucket of its payload {device_uuid: [(name, handle), ...]}
    ({} for an empty bucket); rank 0 passes the merged payloads to `update` (TensorRT-LLM's
    `update_weights`, skipped when they are all empty), then `update(None)` to finish, and a barrier
    closes the exchange. `to_handle` (`reduce_tensor`) makes a handle of a contiguous tensor on `device`.
    A handle does not keep its tensor alive: each rank holds a bucket's tensors until the next bucket's
    gather (which rank 0 joins only once `update` has returned) or the closing barrier."""
    distributed = dist.is_initialized()
    lead = not distributed or dist.get_rank() == 0
    buckets, held = 0, []
    for bucket in stream:
        shared = [(name, tensor.to(device).contiguous()) for name, tensor in bucket.items()]
        payload = {device_uuid: [(name, to_handle(tensor)) for name, tensor in shared]} if shared else {}
        parts = collectives.all_gather_object(payload) if distributed else [payload]
        held = shared  # the previous bucket's handles have been read (see above)
        merged = {}
        for part in parts:
            for uuid, handles in part.items():
                merged.setdefault(uuid, []).extend(handles)
        if lead and merged:
            update(merged)
        buckets += 1
    if lead:
        update(None)
    if distributed:
        collectives.barrier()
    del held  # the last bucket's tensors, kept until the barrier
    return buckets


class TensorRTLLMEngine:
    """GenerationBackend on TensorRT-LLM. Built once from a Hugging Face directory (export the actor
    with `aligner convert mcore-to-hf` or `iter_hf_weights`), then refit from the weight stream.
    Build it on every rank (refit is collective); global rank 0 holds the LLM, generates and issues
    the RPCs (`aligner.generation.backends.JobTensorRTLLM` routes every rank's prompts there)."""

    def __init__(self, hf_dir: str, tensor_parallel_size: int = 1, eos_id: Optional[int] = None, pad_id: int = 0,
                 max_batch_size: int = 256, max_seq_len: int = 4096, kv_cache_fraction: float = 0.5):
        trt = require("tensorrt_llm")
        from tensorrt_llm.llmapi import KvCacheConfig  # optional dependency

        self._trt = trt
        self.eos_id, self.pad_id = eos_id, pad_id
        self.llm = None  # the other ranks only take part in refit
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.llm = trt.LLM(model=str(hf_dir), backend="pytorch", orchestrator_type="ray",
                               ray_worker_extension_cls="tensorrt_llm.llmapi.rlhf_utils.WorkerExtension",
                               tensor_parallel_size=tensor_parallel_size, enable_sleep=True,
                               max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                               kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=kv_cache_fraction))

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: Optional[Sequence[int]] = None) -> Rollout:
        seeds = list(seeds) if seeds is not None else [params.seed * 1_000_003 + i for i in range(len(prompts))]
        sampling = [self._trt.SamplingParams(**sampling_kwargs(params, s, self.eos_id)) for s in seeds]
        outputs = self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False)
        return rollout_from_outputs(outputs, prompts, params, self.eos_id, self.pad_id)

    def refit(self, weight_stream: Optional[WeightStream] = None) -> None:
        """Collective over every rank (`send_weight_stream`)."""
        if weight_stream is None:
            raise ValueError("TensorRT-LLM holds its own copy of the weights: refit needs a weight stream")
        from tensorrt_llm._torch.utils import get_device_uuid  # optional dependency

        index = torch.cuda.current_device()
        send_weight_stream(weight_stream, get_device_uuid(index), torch.device("cuda", index), reduce_tensor,
                           lambda payload: self.llm._collective_rpc("update_weights", args=(payload,)))

    def sleep(self) -> None:
        self.llm._collective_rpc("sleep", args=(list(MEMORY_TAGS),))

    def wake(self) -> None:
        self.llm._collective_rpc("wakeup", args=(list(MEMORY_TAGS),))
