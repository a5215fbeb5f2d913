"""HF <-> megatron mapping: pure functions (configs, names, layouts, TP split rules, clear errors),
plus single-process parity for Mistral and Llama-3 rope scaling (import, score, export)."""
from __future__ import annotations

import inspect
import json

import pytest
import torch
from omegaconf import OmegaConf

from aligner.config.schema import ModelConfig
from aligner.models import hf_weights as hw
from tests import hf_workers as hfw
from tests.conftest import write_jsonl_lines


def _model_cfg(hf_config: dict, tp: int = 1):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), hw.model_fields_from_hf(hf_config),
                           {"tensor_model_parallel_size": tp})


def _hf_dict(kind: str, **overrides) -> dict:
    d = hfw.hf_config(kind, **overrides).to_dict()
    d["architectures"] = [{"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[kind]]
    return d


# ---- configs --------------------------------------------------------------------------------
def test_config_fields():
    f = hw.model_fields_from_hf(_hf_dict("qwen2"))
    assert (f["num_layers"], f["hidden_size"], f["num_attention_heads"], f["num_query_groups"], f["ffn_hidden_size"],
            f["vocab_size"], f["rotary_base"], f["norm_epsilon"]) == (2, 64, 4, 2, 128, 320, 1e6, 1e-5)
    assert f["tie_embeddings"] and f["add_qkv_bias"] and f["rope_scaling_factor"] is None
    f = hw.model_fields_from_hf(_hf_dict("llama3"))
    assert f["rope_scaling_factor"] == 8.0 and f["rotary_base"] == 500000.0 and f["seq_length"] == 16384
    assert not hw.model_fields_from_hf(_hf_dict("llama"))["add_qkv_bias"]
    # transformers<5 style: top-level rope_theta / rope_scaling
    old = {**_hf_dict("llama"), "rope_theta": 123.0, "rope_scaling": {"type": "llama3", "factor": 4.0,
           "low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}}
    old.pop("rope_parameters")
    f = hw.model_fields_from_hf(old)
    assert f["rotary_base"] == 123.0 and f["rope_scaling_factor"] == 4.0


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "mistral"])
def test_config_round_trip(kind):
    from transformers import AutoConfig

    hf = _hf_dict(kind)
    arch = hf["architectures"][0]
    exported = hw.hf_config_from_model(_model_cfg(hf), 320, arch, base=hf)
    assert hw.model_fields_from_hf(exported) == hw.model_fields_from_hf(hf)
    assert exported["bos_token_id"] == 0 and exported["eos_token_id"] == 1
    parsed = AutoConfig.for_model(**{k: v for k, v in exported.items() if k != "model_type"}, model_type=exported["model_type"])
    assert parsed.head_dim == (32 if kind == "mistral" else 16) and parsed.num_key_value_heads == 2
    # without a stored architecture: Qwen2 iff q/k/v biases
    assert hw.hf_config_from_model(_model_cfg(hf), 320)["architectures"] == [
        "Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"]


def test_megatron_llama3_constants():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    defaults = {k: p.default for k, p in inspect.signature(RotaryEmbedding._apply_scaling).parameters.items()}
    assert {k: float(defaults[k]) for k in hw.MEGATRON_LLAMA3_ROPE} == hw.MEGATRON_LLAMA3_ROPE


@pytest.mark.parametrize("kind, overrides, message", [
    ("llama", {"architectures": ["GPT2LMHeadModel"]}, "unsupported Hugging Face architecture"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                    "rope_theta": 5e5}}, "low_freq_factor=2.0 (megatron uses 1.0)"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "rope_theta": 5e5}},
     "original_max_position_embeddings=16384 (megatron uses 8192)"),
    ("mistral", {"sliding_window": 64}, "sliding_window=64 < max_position_embeddings=256"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "layer_types": ["sliding_attention"] * 2},
     "sliding_window=32"),
    ("llama", {"attention_bias": True}, "o_proj bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "gelu"}, "only SwiGLU"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_configs(kind, overrides, message):
    hf = {**_hf_dict(kind), **overrides}
    with pytest.raises(hw.UnsupportedModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hw.model_fields_from_hf(hf)


def test_harmless_windows_are_accepted():
    hw.model_fields_from_hf({**_hf_dict("mistral"), "sliding_window": 4096})  # >= max_position_embeddings
    hw.model_fields_from_hf({**_hf_dict("qwen2"), "sliding_window": 16, "use_sliding_window": False,
                             "layer_types": ["full_attention"] * 2})


# ---- tensors --------------------------------------------------------------------------------
def _random_hf_state(g: hw.Geometry) -> dict:
    torch.manual_seed(0)
    names = [n for m in hw.mcore_names(g) for n in hw.hf_names(m, g)]
    shapes = {"q_proj": (g.heads * g.head_dim,), "k_proj": (g.groups * g.head_dim,), "v_proj": (g.groups * g.head_dim,),
              "o_proj": (g.hidden, g.heads * g.head_dim), "gate_proj": (g.ffn, g.hidden), "up_proj": (g.ffn, g.hidden),
              "down_proj": (g.hidden, g.ffn), "embed_tokens": (g.vocab, g.hidden), "lm_head": (g.vocab, g.hidden)}
    state = {}
    for n in names:
        key = next((k for k in shapes if k in n), None)
        shape = (g.hidden,) if key is None else shapes[key]
        if key in ("q_proj", "k_proj", "v_proj"):
            shape = shape if n.endswith("bias") else (shape[0], g.hidden)
        state[n] = torch.randn(shape)
    return state


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_state_round_trip_and_shapes(kind):
    g = hw.Geometry.of(_model_cfg(_hf_dict(kind)), 320, tp=2)
    hf = _random_hf_state(g)
    mcore = hw.hf_to_mcore_state(hf, g)
    assert all(tuple(t.shape) == hw.full_shape(n, g) for n, t in mcore.items())
    assert g.padded_vocab == 512 and mcore["embedding.word_embeddings.weight"][320:].abs().sum() == 0
    back = hw.mcore_to_hf_state(mcore, g)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert ("lm_head.weight" in back) == (kind == "llama")


def test_qkv_layout_is_grouped():
    g = hw.Geometry(hidden=4, heads=4, groups=2, head_dim=1, ffn=8, vocab=4, padded_vocab=4, num_layers=1, tied=False,
                    qkv_bias=True)
    hf = {"model.layers.0.self_attn.q_proj.bias": torch.tensor([0., 1, 2, 3]),  # q heads 0..3
          "model.layers.0.self_attn.k_proj.bias": torch.tensor([10., 11]), "model.layers.0.self_attn.v_proj.bias": torch.tensor([20., 21])}
    fused = hw.from_hf("decoder.layers.0.self_attention.linear_qkv.bias", hf.__getitem__, g)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert hw.shard("decoder.layers.0.self_attention.linear_qkv.bias", fused, 2, 1).tolist() == [2, 3, 11, 21]


def test_split_rules():
    fc1 = torch.arange(8.).unsqueeze(1)  # gate rows 0..3, up rows 4..7
    name = "decoder.layers.3.mlp.linear_fc1.weight"
    assert hw.shard(name, fc1, 2, 0).flatten().tolist() == [0, 1, 4, 5]
    assert hw.shard(name, fc1, 2, 1).flatten().tolist() == [2, 3, 6, 7]
    w = torch.randn(8, 12)
    for name, expect in [("decoder.layers.0.self_attention.linear_proj.weight", w.chunk(4, 1)[2]),
                         ("decoder.layers.0.mlp.linear_fc2.weight", w.chunk(4, 1)[2]),
                         ("embedding.word_embeddings.weight", w.chunk(4, 0)[2]), ("output_layer.weight", w.chunk(4, 0)[2]),
                         ("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([w[2:3], w[6:7]])),  # gate_2, up_2
                         ("decoder.final_layernorm.weight", w)]:
        shards = [hw.shard(name, w, 4, r) for r in range(4)]
        assert torch.equal(shards[2], expect), name
        assert torch.equal(hw.unshard(name, shards), w), name
    with pytest.raises(ValueError, match="does not split over TP=5"):
        hw.shard("decoder.layers.0.mlp.linear_fc2.weight", w, 5, 0)


def test_names():
    assert hw.canonical_name("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", 4) == \
        "decoder.layers.5.input_layernorm.weight"
    assert hw.canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.0.pre_mlp_layernorm.weight"
    g = hw.Geometry.of(_model_cfg(_hf_dict("qwen2")), 320)
    assert hw.hf_names("output_layer.weight", g) == ("model.embed_tokens.weight",)  # tied
    assert "output_layer.weight" not in hw.mcore_names(g)


# ---- single-process conversions -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mistral", "llama3"])
def test_single_rank_parity_and_round_trip(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    from aligner.models.hf_convert import hf_to_mcore, mcore_to_hf
    from aligner.models.scoring import score_logprobs

    model = hfw.make_hf_model(kind, tmp_path / "hf", seed=3)
    hf_to_mcore(tmp_path / "hf", tmp_path / "ckpt")
    data = write_jsonl_lines(tmp_path / "data.jsonl", [{"text": t} for t in hfw.TEXTS])
    score_logprobs(tmp_path / "ckpt", data, tmp_path / "lp.jsonl")
    worst = 0.0
    for line in (tmp_path / "lp.jsonl").read_text().splitlines():
        row = json.loads(line)
        ref = hfw.hf_token_logprobs(model, torch.tensor([row["input_ids"]]))
        worst = max(worst, (ref - torch.tensor(row["logprobs"])).abs().max().item())
    assert worst <= 1e-4, worst

    out = mcore_to_hf(tmp_path / "ckpt", tmp_path / "out")
    exported = hfw.load_safetensors_dir(out)
    original = model.state_dict()
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([[0, 5, 9, 33, 200, 7, 8, 9]])
    assert torch.equal(hfw.hf_logits(reloaded, ids), hfw.hf_logits(model, ids))
    if kind == "llama3":
        assert reloaded.config.rope_parameters["rope_type"] == "llama3"
    else:
        assert hw.model_fields_from_hf(reloaded.config.to_dict())["kv_channels"] == 32
        half = mcore_to_hf(tmp_path / "ckpt", tmp_path / "bf16", dtype="bfloat16")
        assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
        assert all(torch.equal(t, original[k].bfloat16()) for k, t in hfw.load_safetensors_dir(half).items())
