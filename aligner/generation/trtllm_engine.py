"""TensorRT-LLM rollout backend: a thin adapter (GPU hosts only; optional extra `aligner[trtllm]`).

Target: TensorRT-LLM 1.2.x, PyTorch backend, `tensorrt_llm.LLM` with `orchestrator_type="ray"` and
the RL worker extension `tensorrt_llm.llmapi.rlhf_utils.WorkerExtension`, whose RPCs we use:
  * `update_weights(ipc_handles)` with {device_uuid: [(hf_name, cuda_ipc_handle), ...]} once per
    bucket of our HF-named weight stream, then `update_weights(None)` to finalise the reload;
  * `sleep(tags)` / `wakeup(tags)` with the memory tags "model" and "kv_cache".
The TensorRT *engine* refit path is not used: it was removed upstream (PyTorch is TRT-LLM's only
backend on main).

Where TensorRT-LLM departs from the conventions of `aligner.generation.types`, the adapter restores them or says so:
  * log-probs: TensorRT-LLM returns those of the raw logits unless `SamplingParams.logprobs_mode` asks for the
    processed ones (the temperature / top-k / top-p distribution it sampled from); where that setting does not
    exist, sampling other than plain temperature 1 is refused, as its log-probs would bias the ratios silently;
  * stop strings: TensorRT-LLM matches a stop string's token ids, not its text; each response is cut here at the
    first token whose decoded text holds one, as the Megatron engine cuts it;
  * seeds: its default sampler draws from one generator, not from each request's seed, so a sample depends on
    its batch (not corrected: the Megatron engine is the reproducible one).

What was exercised where: the pure functions here (`sampling_kwargs`, `rollout_from_outputs`) and
`send_weight_stream`'s collective protocol (with a stand-in for the IPC handle) run in the CPU test
suite. Starting the engine, generating and `update_weights` were NOT exercised in this project's
workplace: TensorRT-LLM cannot be installed on the CPU CI machines (PyPI only hosts a stub) nor
carried to the lent GPU machine. Treat this backend as untested until it has run on a GPU image with
TensorRT-LLM, and compare its rollouts with the Megatron engine there (`mismatch/*` metrics).
"""
from __future__ import annotations

import enum
import functools
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from aligner.errors import ConfigError
from aligner.generation.types import (STOP_EOS, STOP_LENGTH, STOP_STRING, STOP_TOKEN, Rollout, SamplingParams,
                                      WeightStream)
from aligner.runtime import collectives
from aligner.runtime.optional import require

# tensorrt_llm is imported inside the engine's methods: it is an optional dependency (GPU images only).

MEMORY_TAGS = ("model", "kv_cache")


def sampling_kwargs(params: SamplingParams, seed: int, eos_id: Optional[int], processed=None) -> dict:
    """Our SamplingParams as keyword arguments of `tensorrt_llm.SamplingParams` (one-to-one).

    Greedy maps to top_k=1 at temperature 1, so the returned log-probs are those of the model's own
    distribution, the convention of `aligner.generation.types`. Sampling that reshapes the distribution needs
    `processed`, the `logprobs_mode` value that returns the sampled distribution's log-probs (module doc)."""
    kwargs = dict(max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens, seed=int(seed),
                  end_id=eos_id, stop_token_ids=list(params.stop_token_ids) or None,
                  stop=list(params.stop_strings) or None, include_stop_str_in_output=True, logprobs=1)
    if params.is_greedy:
        return {**kwargs, "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    kwargs.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    if params.temperature != 1.0 or params.top_k or params.top_p < 1.0:
        if processed is None:
            raise ConfigError("this TensorRT-LLM returns the raw logits' log-probs only (its SamplingParams has no "
                              "logprobs_mode), not those of the temperature/top-k/top-p distribution it samples from",
                              "sampling.temperature / top_k / top_p",
                              "sample at temperature 1 without top-k/top-p, or use generation.backend=megatron")
        kwargs["logprobs_mode"] = processed
    return kwargs


def processed_logprobs_mode(sampling_params_class):
    """The `logprobs_mode` value of `sampling_params_class` (TensorRT-LLM's SamplingParams) that returns the
    log-probs of the processed (sampled) distribution, or None where the setting does not exist."""
    fields = getattr(sampling_params_class, "__dataclass_fields__", {})  # a dataclass in TensorRT-LLM 1.x
    if "logprobs_mode" not in fields:
        return None
    default = getattr(fields["logprobs_mode"], "default", None)
    if isinstance(default, enum.Enum):
        for member in type(default):
            if str(member.value).startswith("processed"):
                return member
        return None
    return "processed"


def stop_string_cut(decode, ids: Sequence[int], strings: Sequence[str]) -> Optional[int]:
    """The length of the shortest prefix of `ids` whose text (`decode`) holds one of `strings`, or None: where
    the Megatron engine's StopStrings would have stopped. Bisected: a prefix that holds one, its extensions do."""
    if not strings or not any(s in decode(list(ids)) for s in strings):
        return None
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if any(s in decode(list(ids[:middle])) for s in strings):
            high = middle
        else:
            low = middle + 1
    return low


def _chosen_logprob(entry, token: int) -> float:
    """TRT-LLM reports a float, or a {token: Logprob | float} dict of the top candidates."""
    if isinstance(entry, Mapping):
        value = entry[token]
        return float(getattr(value, "logprob", value))
    return float(entry)


def rollout_from_outputs(outputs: Sequence, prompts: list[list[int]], params: SamplingParams,
                         eos_id: Optional[int], pad_id: int, decode=None) -> Rollout:
    """`LLM.generate` results (one RequestOutput per prompt, first completion used) -> Rollout. `decode`
    (token ids -> text, special tokens skipped) cuts each response at its first stop string (module doc)."""
    responses, logprobs, reasons = [], [], []
    for out in outputs:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        lps = [_chosen_logprob(e, t) for e, t in zip(completion.logprobs or [], ids)] or [0.0] * len(ids)
        cut = stop_string_cut(decode, ids, params.stop_strings) if decode is not None else None
        if cut is not None:
            ids, lps = ids[:cut], lps[:cut]
        responses.append(ids)
        logprobs.append(lps)
        last = ids[-1] if ids else None
        if cut is not None:
            reasons.append(STOP_STRING)
        elif completion.finish_reason == "length":
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

        self._trt, self._processed = trt, processed_logprobs_mode(trt.SamplingParams)
        self.eos_id, self.pad_id, self.hf_dir, self._tokenizer = eos_id, pad_id, str(hf_dir), None
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
        sampling = [self._trt.SamplingParams(**sampling_kwargs(params, s, self.eos_id, self._processed))
                    for s in seeds]
        outputs = self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False)
        decode = None
        if params.stop_strings:
            if self._tokenizer is None:
                from transformers import AutoTokenizer  # the export's tokenizer, once

                self._tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
            decode = functools.partial(self._tokenizer.decode, skip_special_tokens=True)
        return rollout_from_outputs(outputs, prompts, params, self.eos_id, self.pad_id, decode)

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
