"""conf/model/*.yaml against the Hugging Face configs they claim to be.

The HF values below are a second transcription, made independently of the YAML files, from each model's
config.json on the Hugging Face Hub (the URL above each dict; gated repos show config.json after accepting the
licence). transformers' own config classes do not carry these models' sizes (LlamaConfig's defaults are
Llama-2-7B's, MistralConfig's Mistral-7B-v0.1's, Qwen2Config's Qwen2-7B's), so they are used here only to
normalise each dict the way transformers loads it (transformers>=5 moves rope_theta/rope_scaling into
rope_parameters), and the mapping is checked on both forms. Published total parameter counts (model cards:
8.03B, 70.6B, 405B, 7.61B, 72.7B, 7.25B) are checked against a transformers model built on the meta device.
"""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from aligner import CONF_DIR
from aligner.config.schema import ModelConfig
from aligner.models import hf_weights as hw

_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rope_theta": 500000.0, "rope_scaling": None, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
             "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}
# https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}
# https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
LLAMA31_8B = {**LLAMA3_8B, "max_position_embeddings": 131072, "rope_scaling": _LLAMA31_ROPE}
# https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
LLAMA31_70B = {**LLAMA3_70B, "max_position_embeddings": 131072, "rope_scaling": _LLAMA31_ROPE}
# https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json
LLAMA31_405B = {**LLAMA3_8B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                "num_attention_heads": 128, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rope_scaling": _LLAMA31_ROPE}
# https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
             "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "sliding_window": 131072, "use_sliding_window": False,
             "max_window_layers": 28, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
             "bos_token_id": 151643, "eos_token_id": 151643}
# https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json
QWEN25_72B = {**QWEN25_7B, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "max_window_layers": 80}
# https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json
MISTRAL_7B_V03 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
                  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768,
                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "sliding_window": None,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}

# file -> (HF config.json, total parameters as published on the model card, in billions, and its rounding)
MODELS = {
    "llama3_8b": (LLAMA3_8B, 8.03, 0.005),
    "llama3_70b": (LLAMA3_70B, 70.6, 0.05),
    "llama31_8b": (LLAMA31_8B, 8.03, 0.005),
    "llama31_70b": (LLAMA31_70B, 70.6, 0.05),
    "llama31_405b": (LLAMA31_405B, 405.0, 1.0),  # the card says "405B"; the exact count is 405.85 B
    "qwen25_7b": (QWEN25_7B, 7.61, 0.01),  # the card truncates 7.6156 B to 7.61
    "qwen25_72b": (QWEN25_72B, 72.7, 0.05),
    "mistral_7b": (MISTRAL_7B_V03, 7.25, 0.005),
}


def _model_yaml(name: str):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml").model)


def test_every_model_file_is_covered():
    assert {p.stem for p in (CONF_DIR / "model").glob("*.yaml")} - {"tiny"} == set(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_file_matches_hf_config(name):
    hf, _, _ = MODELS[name]
    m = _model_yaml(name)
    heads = hf["num_attention_heads"]
    # the correspondence written out here, not taken from aligner.models.hf_weights
    assert m.num_layers == hf["num_hidden_layers"]
    assert m.hidden_size == hf["hidden_size"]
    assert m.num_attention_heads == heads
    assert m.num_query_groups == hf["num_key_value_heads"]
    assert m.ffn_hidden_size == hf["intermediate_size"]
    assert (m.kv_channels or m.hidden_size // m.num_attention_heads) == hf["hidden_size"] // heads == 128
    assert m.vocab_size == hf["vocab_size"]
    assert m.max_position_embeddings == hf["max_position_embeddings"]
    assert m.rotary_base == hf["rope_theta"]
    rope = hf.get("rope_scaling")
    assert m.rope_scaling_factor == (rope["factor"] if rope else None)
    assert m.norm_epsilon == hf["rms_norm_eps"]
    assert m.tie_embeddings == hf["tie_word_embeddings"]
    assert m.add_qkv_bias == (hf["model_type"] == "qwen2")  # Qwen2 has q/k/v biases, Llama and Mistral none
    assert m.params_dtype == hf["torch_dtype"] == "bfloat16"
    # a training layout that the validator accepts, and a training length the model supports
    assert m.seq_length <= m.max_position_embeddings and m.seq_length in (4096, 8192)
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    assert heads % tp == 0 and hf["num_key_value_heads"] % tp == 0 and m.num_layers % pp == 0 and tp <= 8


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_mapping_yields_the_model_file(name):
    """aligner's own HF -> ModelConfig mapping, fed the raw config.json and transformers' loaded form of it,
    gives every architecture field of the file (seq_length is the training length, the mapping's is the
    model's maximum)."""
    from transformers import AutoConfig

    hf, _, _ = MODELS[name]
    m = OmegaConf.to_container(_model_yaml(name))
    loaded = AutoConfig.for_model(**hf).to_dict()
    loaded["architectures"] = hf["architectures"]
    for form in (hf, loaded):
        fields = hw.model_fields_from_hf(form)
        assert fields.pop("seq_length") == hf["max_position_embeddings"]
        assert fields == {k: m[k] for k in fields}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameter_count_matches_the_model_card(name):
    """transformers' model for the transcribed config, on the meta device: its size is the published one (a check
    on the transcription itself, independent of aligner)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, published_b, rounding = MODELS[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / 1e9 - published_b) <= rounding, f"{name}: {total / 1e9:.3f} B"


def test_mistral_v01_sliding_window_is_refused():
    """Why conf/model/mistral_7b.yaml is v0.3: v0.1's 4096-token window cannot be represented."""
    v01 = {**MISTRAL_7B_V03, "vocab_size": 32000, "rope_theta": 10000.0, "sliding_window": 4096}
    with pytest.raises(hw.UnsupportedModelError, match="sliding_window=4096"):
        hw.model_fields_from_hf(v01)
