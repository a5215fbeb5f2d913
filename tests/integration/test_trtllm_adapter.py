"""The TensorRT-LLM adapter's pure parts (the engine itself needs a GPU image with TensorRT-LLM)."""
import dataclasses
import enum
from types import SimpleNamespace

import pytest
import torch

from aligner.errors import ConfigError
from aligner.generation.trtllm_engine import (TensorRTLLMEngine, processed_logprobs_mode, rollout_from_outputs,
                                              sampling_kwargs, send_weight_stream, stop_string_cut)
from aligner.generation.types import SamplingParams
from aligner.runtime.optional import MissingOptionalDependency, probe


class LogprobMode(enum.Enum):  # TensorRT-LLM's, as its SamplingParams declares it where it has the setting
    RAW = "raw"
    PROCESSED = "processed"


@dataclasses.dataclass
class WithMode:
    logprobs_mode: LogprobMode = LogprobMode.RAW


@dataclasses.dataclass
class WithoutMode:
    temperature: float = 1.0


def test_sampling_params_map_one_to_one_and_ask_for_the_sampled_distributions_log_probs():
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_new_tokens=2, max_new_tokens=16,
                            stop_token_ids=(7,), stop_strings=("\n\n",))
    processed = processed_logprobs_mode(WithMode)
    assert processed is LogprobMode.PROCESSED and processed_logprobs_mode(WithoutMode) is None
    assert sampling_kwargs(params, seed=5, eos_id=1, processed=processed) == dict(
        max_tokens=16, min_tokens=2, seed=5, end_id=1, stop_token_ids=[7], stop=["\n\n"],
        include_stop_str_in_output=True, logprobs=1, temperature=0.7, top_k=20, top_p=0.9,
        logprobs_mode=LogprobMode.PROCESSED)
    greedy = sampling_kwargs(SamplingParams(greedy=True, temperature=0.3), seed=0, eos_id=1)
    assert (greedy["top_k"], greedy["temperature"], greedy["stop_token_ids"], greedy["stop"]) == (1, 1.0, None, None)
    assert "logprobs_mode" not in greedy  # raw: processed with top_k=1 would be 0
    plain = sampling_kwargs(SamplingParams(temperature=1.0), seed=0, eos_id=1)  # raw is what it samples from
    assert "logprobs_mode" not in plain
    # without the setting its log-probs would be the raw logits', not the sampled distribution's: refused
    with pytest.raises(ConfigError, match="raw logits.*sampling.temperature / top_k / top_p.*backend=megatron"):
        sampling_kwargs(SamplingParams(temperature=0.7), seed=0, eos_id=1)


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


def test_a_response_is_cut_at_its_first_stop_string_as_the_megatron_engine_cuts_it():
    """TensorRT-LLM matches a stop string's token ids: "\n\n" written as two "\n" tokens ran on to the length
    limit; the text decides, as StopStrings does (aligner/generation/stopping.py)."""
    vocab = {1: "<eos>", 3: "a", 4: "\n", 5: "b", 6: "\n\n"}
    decode = lambda ids: "".join(vocab[i] for i in ids if i != 1)  # noqa: E731 - special tokens skipped
    params = SamplingParams(stop_strings=("\n\n",), max_new_tokens=6)
    outputs = [_output([3, 4, 4, 5, 5, 5], [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], "length"),
               _output([3, 6], [-1.0, -2.0], "stop"),  # its own match, the same cut
               _output([3, 4, 1], [-1.0, -2.0, -3.0], "stop")]  # eos first: no stop string
    rollout = rollout_from_outputs(outputs, [[2]] * 3, params, eos_id=1, pad_id=0, decode=decode)
    assert rollout.responses() == [[3, 4, 4], [3, 6], [3, 4, 1]]
    assert rollout.response_logprobs()[0] == [-1.0, -2.0, -3.0]
    assert rollout.stop_reason == ["stop_string", "stop_string", "eos"] and rollout.is_end.tolist() == [True] * 3
    assert stop_string_cut(decode, [3, 5], ("\n\n",)) is None


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
