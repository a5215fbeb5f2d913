"""The TensorRT-LLM adapter's pure parts (the engine itself needs a GPU image with TensorRT-LLM)."""
from types import SimpleNamespace

import pytest
import torch

from aligner.generation.trtllm_engine import (TensorRTLLMEngine, rollout_from_outputs, sampling_kwargs,
                                              send_weight_stream)
from aligner.generation.types import SamplingParams
from aligner.runtime.optional import MissingOptionalDependency, probe


def test_sampling_params_map_one_to_one():
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_new_tokens=2, max_new_tokens=16,
                            stop_token_ids=(7,), stop_strings=("\n\n",))
    assert sampling_kwargs(params, seed=5, eos_id=1) == dict(
        max_tokens=16, min_tokens=2, seed=5, end_id=1, stop_token_ids=[7], stop=["\n\n"],
        include_stop_str_in_output=True, logprobs=1, temperature=0.7, top_k=20, top_p=0.9)
    greedy = sampling_kwargs(SamplingParams(greedy=True, temperature=0.3), seed=0, eos_id=1)
    assert (greedy["top_k"], greedy["temperature"], greedy["stop_token_ids"], greedy["stop"]) == (1, 1.0, None, None)


def _output(ids, logprobs, finish):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason=finish)])


def test_outputs_become_a_rollout():
    params = SamplingParams(stop_token_ids=(9,), max_new_tokens=3)
    outputs = [_output([4, 1], [-0.5, -0.25], "stop"),  # eos
               _output([5, 6, 7], [{5: SimpleNamespace(logprob=-1.0)}, {6: -2.0}, {7: -3.0}], "length"),
               _output([9], [-0.125], "stop"),  # stop token
               _output([3, 3], [-1.0, -1.0], "stop")]  # stop string
    rollout = rollout_from_outputs(outputs, [[2], [2], [2], [2]], params, eos_id=1, pad_id=0)
    assert rollout.responses() == [[4, 1], [5, 6, 7], [9], [3, 3]]
    assert torch.equal(rollout.response_ids[0], torch.tensor([4, 1, 0]))
    assert rollout.response_logprobs()[1] == [-1.0, -2.0, -3.0]
    assert rollout.is_end.tolist() == [True, False, True, True]
    assert rollout.stop_reason == ["eos", "length", "stop_token", "stop_string"]


def test_send_weight_stream_hands_over_contiguous_tensors_and_finishes():
    # one process (across ranks: tests/integration/test_weight_stream_collectives.py); an empty bucket is no update
    stream = [{"a": torch.zeros(1)}, {}, {"b": torch.ones(2, 3).t(), "c": torch.ones(3)}]
    updates = []
    buckets = send_weight_stream(stream, "GPU-x", "cpu", lambda t: (t.numel(), t.is_contiguous()), updates.append)
    assert buckets == 3
    assert updates == [{"GPU-x": [("a", (1, True))]}, {"GPU-x": [("b", (6, True)), ("c", (3, True))]}, None]


@pytest.mark.skipif(probe("tensorrt_llm").importable, reason="TensorRT-LLM is importable here")
def test_missing_tensorrt_llm_names_the_extra():
    with pytest.raises(MissingOptionalDependency, match=r"aligner\[trtllm\]|cannot load"):
        TensorRTLLMEngine("/nonexistent")
