"""Pure mapping between Hugging Face Llama-family checkpoints and megatron-core GPT parameters.

No torch.distributed here: configs are dicts, state dicts are name -> Tensor.

Names. Megatron names are *canonical*: global layer index (``layer_offset + local index`` under
pipeline parallelism) and local-spec norm names (Transformer-Engine's fused
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` are aliases, see
`canonical_name`). A "full" megatron tensor is the TP=1 tensor, with the embedding / output
padded to `Geometry.padded_vocab` rows (zeros on import, dropped on export).

Layouts (megatron <- HF):
  linear_qkv   per query group g: [q heads of g (heads/groups * head_dim rows), k_g, v_g], groups
               concatenated; HF's q head h belongs to kv group h // (heads/groups) (repeat_kv order).
  linear_fc1   [gate; up] (SwiGLU: silu(gate) * up).
  RoPE         both sides rotate halves (non-interleaved), so q/k rows need no permutation.

Tensor parallelism (`shard` / `unshard`): qkv and the vocab rows split on dim 0 (qkv in whole
query groups), linear_proj / linear_fc2 on dim 1, fc1 per half (rank r holds
[gate_r; up_r], not a plain chunk of [gate; up]), norms are replicated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from aligner.errors import UserError
from aligner.models.gpt import padded_vocab_size

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
# Reward models: the same backbone with a `score` head [num_labels, hidden] instead of `lm_head`
# (megatron side: `aligner.models.heads.ScalarHead`, replicated over TP, never vocab-padded).
SEQUENCE_CLASSIFICATION = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                           "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                           "MistralForSequenceClassification": "MistralForCausalLM"}
# Megatron's RotaryEmbedding._apply_scaling (llama3 rope) takes only `factor` from us; the rest are
# its fixed defaults, which an HF config must match (tests/integration/test_hf_weights.py checks these against megatron).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(UserError, ValueError):
    """The HF model cannot be represented exactly by our megatron GPT."""


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------
def hf_architecture(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in {**ARCHITECTURES, **SEQUENCE_CLASSIFICATION}:
        raise UnsupportedModelError(f"unsupported Hugging Face architecture {archs or hf_config.get('model_type')}; "
                                    f"supported: {', '.join([*ARCHITECTURES, *SEQUENCE_CLASSIFICATION])}")
    return archs[0]


def _rope(hf_config: dict) -> tuple[float, str, dict]:
    """(theta, rope type, parameters) from either transformers>=5 `rope_parameters` or the older
    top-level `rope_theta` + `rope_scaling`."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return float(theta), rope_type, params


def _check_supported(hf_config: dict, arch: str) -> None:
    name = f"{arch} config"
    if hf_config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"{name}: hidden_act={hf_config['hidden_act']!r}; only SwiGLU (silu) is supported")
    if hf_config.get("mlp_bias"):
        raise UnsupportedModelError(f"{name}: mlp_bias=true is not supported (megatron GPT has bias-free MLPs)")
    if arch == "LlamaForCausalLM" and hf_config.get("attention_bias"):
        raise UnsupportedModelError(f"{name}: attention_bias=true adds an o_proj bias, which is not supported "
                                    "(only Qwen2-style q/k/v biases are)")
    if float(_rope(hf_config)[2].get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModelError(f"{name}: partial_rotary_factor != 1 is not supported")
    layer_types = set(hf_config.get("layer_types") or [])
    if layer_types - {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(f"{name}: layer_types {sorted(layer_types)} are not supported")
    window, max_pos = hf_config.get("sliding_window"), hf_config.get("max_position_embeddings")
    if arch == "Qwen2ForCausalLM":  # windows apply only where layer_types (or use_sliding_window) say so
        active = "sliding_attention" in layer_types if layer_types else hf_config.get("use_sliding_window", False)
    else:
        active = arch == "MistralForCausalLM"
    if active and window is not None and (max_pos is None or window < max_pos):
        raise UnsupportedModelError(
            f"{name}: sliding_window={window} < max_position_embeddings={max_pos} restricts attention on long inputs, "
            "but megatron GPT attends to the full causal context; set sliding_window to null in config.json only if "
            "you accept that difference beyond the window")
    heads, groups = hf_config["num_attention_heads"], hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    if heads % groups:
        raise UnsupportedModelError(f"{name}: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")


def _rope_scaling_factor(hf_config: dict) -> float | None:
    _, rope_type, params = _rope(hf_config)
    if rope_type in ("default", None):
        return None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (supported: default, llama3)")
    # HF falls back to max_position_embeddings for a missing original_max_position_embeddings
    effective = {**params, "original_max_position_embeddings": params.get(
        "original_max_position_embeddings", hf_config.get("max_position_embeddings"))}
    mismatched = {k: (effective.get(k), v) for k, v in MEGATRON_LLAMA3_ROPE.items()
                  if effective.get(k) is None or float(effective[k]) != float(v)}
    if mismatched:
        detail = ", ".join(f"{k}={hf} (megatron uses {mc})" for k, (hf, mc) in mismatched.items())
        raise UnsupportedModelError(f"llama3 rope scaling with {detail}: megatron's RotaryEmbedding hard-codes these "
                                    "constants, so logits would differ")
    return float(params["factor"])


def model_fields_from_hf(hf_config: dict) -> dict:
    """ModelConfig fields (architecture only, no parallel layout) for an HF config.json dict."""
    arch = hf_architecture(hf_config)
    arch = SEQUENCE_CLASSIFICATION.get(arch, arch)  # the backbone's rules
    _check_supported(hf_config, arch)
    heads = hf_config["num_attention_heads"]
    theta, _, _ = _rope(hf_config)
    head_dim = hf_config.get("head_dim")
    dtype = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32").replace("torch.", "")
    max_pos = hf_config.get("max_position_embeddings", 4096)
    return {
        "num_layers": hf_config["num_hidden_layers"],
        "hidden_size": hf_config["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf_config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf_config["intermediate_size"],
        # an explicit head_dim only where it differs from hidden / heads (Mistral-Nemo style)
        "kv_channels": None if head_dim in (None, hf_config["hidden_size"] // heads) else head_dim,
        "vocab_size": hf_config["vocab_size"],
        "seq_length": max_pos,
        "max_position_embeddings": max_pos,
        "rotary_base": theta,
        "rope_scaling_factor": _rope_scaling_factor(hf_config),
        "norm_epsilon": hf_config.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "add_qkv_bias": arch == "Qwen2ForCausalLM",
        "params_dtype": "bfloat16" if dtype == "bfloat16" else "float32",
    }


# Keys of an imported config.json we keep on export (token ids and the like; the architecture
# itself always comes from the ModelConfig).
PASSTHROUGH_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")


def hf_config_from_model(m, vocab_size: int, architecture: str | None = None, dtype: str = "float32",
                         base: dict | None = None) -> dict:
    """config.json for a ModelConfig `m`. The architecture is `architecture` (as stored at import)
    or, failing that, Qwen2 for q/k/v biases and Llama otherwise. `base`: the imported config.json,
    whose token ids are kept."""
    architecture = architecture or ("Qwen2ForCausalLM" if m.add_qkv_bias else "LlamaForCausalLM")
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"cannot export as {architecture}; supported: {', '.join(ARCHITECTURES)}")
    if m.add_qkv_bias != (architecture == "Qwen2ForCausalLM"):
        raise UnsupportedModelError(f"add_qkv_bias={m.add_qkv_bias} cannot be expressed as {architecture}")
    heads = m.num_attention_heads
    out = {k: base[k] for k in PASSTHROUGH_KEYS if base and k in base}
    out.update({
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": m.num_query_groups or heads,
        "head_dim": m.kv_channels or m.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(m.max_position_embeddings),
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base,
        "rope_scaling": None if m.rope_scaling_factor is None else {
            "rope_type": "llama3", "factor": m.rope_scaling_factor, **MEGATRON_LLAMA3_ROPE},
        "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
    })
    if architecture == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(sliding_window=None, use_sliding_window=False)
    return out


# ---------------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """Shapes the tensor maps need."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int  # true vocabulary size (HF rows)
    padded_vocab: int  # megatron rows at the TP size this geometry was made for
    num_layers: int
    tied: bool
    qkv_bias: bool
    score_outputs: int = 0  # > 0: output_layer is a scalar head <-> HF `score.weight` [score_outputs, hidden]

    @classmethod
    def of(cls, m, vocab_size: int, tp: int | None = None, score_outputs: int = 0) -> "Geometry":
        """For ModelConfig `m`; `tp` (default m's own TP size) sets the vocab padding."""
        tp = m.tensor_model_parallel_size if tp is None else tp
        return cls(hidden=m.hidden_size, heads=m.num_attention_heads, groups=m.num_query_groups or m.num_attention_heads,
                   head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads, ffn=m.ffn_hidden_size,
                   vocab=vocab_size, padded_vocab=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, tp),
                   num_layers=m.num_layers, tied=bool(m.tie_embeddings), qkv_bias=bool(m.add_qkv_bias),
                   score_outputs=score_outputs)


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TE_ALIASES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
# megatron layer suffix -> HF layer suffixes (in concatenation order)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
_GLOBAL_MAP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
               "decoder.final_layernorm.weight": "model.norm.weight",
               "output_layer.weight": "lm_head.weight"}
# TP split rule per megatron parameter (by name suffix): a dim, "glu", or absent = replicated.
_SPLIT = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": "glu", "linear_proj.weight": 1,
          "linear_fc2.weight": 1, "word_embeddings.weight": 0, "output_layer.weight": 0}


def _split_layer(name: str) -> tuple[int, str] | None:
    match = _LAYER_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def canonical_name(name: str, layer_offset: int = 0) -> str:
    """A module's local parameter name -> canonical name (global layer index, local-spec norms)."""
    layer = _split_layer(name)
    if layer is None:
        return name
    index, suffix = layer
    return f"decoder.layers.{index + layer_offset}.{_TE_ALIASES.get(suffix, suffix)}"


def mcore_names(g: Geometry, layers: Iterable[int] | None = None, embedding: bool = True, head: bool = True) -> list[str]:
    """Canonical megatron parameter names, in model order, of the given layers (default all) plus
    the embedding / final norm + output layer. A tied output layer is the embedding: not listed."""
    names = ["embedding.word_embeddings.weight"] if embedding else []
    for i in range(g.num_layers) if layers is None else layers:
        for suffix in _LAYER_MAP:
            if suffix != "self_attention.linear_qkv.bias" or g.qkv_bias:
                names.append(f"decoder.layers.{i}.{suffix}")
    if head:
        names.append("decoder.final_layernorm.weight")
        if not g.tied or g.score_outputs:
            names.append("output_layer.weight")
    return names


def hf_names(name: str, g: Geometry) -> tuple[str, ...]:
    """The HF tensors one canonical megatron parameter is made of."""
    layer = _split_layer(name)
    if layer is not None:
        index, suffix = layer
        return tuple(f"model.layers.{index}.{s}" for s in _LAYER_MAP[suffix])
    if name == "output_layer.weight" and g.score_outputs:
        return ("score.weight",)
    if name == "output_layer.weight" and g.tied:
        return ("model.embed_tokens.weight",)
    return (_GLOBAL_MAP[name],)


def full_shape(name: str, g: Geometry) -> tuple[int, ...]:
    """Shape of a canonical megatron parameter at TP=1 (vocab padded to g.padded_vocab)."""
    suffix = _split_layer(name)[1] if _split_layer(name) else name
    if name == "output_layer.weight" and g.score_outputs:
        return (g.score_outputs, g.hidden)
    qkv_rows = (g.heads + 2 * g.groups) * g.head_dim
    return {"input_layernorm.weight": (g.hidden,), "pre_mlp_layernorm.weight": (g.hidden,),
            "self_attention.linear_qkv.weight": (qkv_rows, g.hidden), "self_attention.linear_qkv.bias": (qkv_rows,),
            "self_attention.linear_proj.weight": (g.hidden, g.heads * g.head_dim),
            "mlp.linear_fc1.weight": (2 * g.ffn, g.hidden), "mlp.linear_fc2.weight": (g.hidden, g.ffn),
            "embedding.word_embeddings.weight": (g.padded_vocab, g.hidden),
            "output_layer.weight": (g.padded_vocab, g.hidden), "decoder.final_layernorm.weight": (g.hidden,)}[suffix]


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------
def _kind(name: str) -> str:
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "glu"
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "vocab"
    return "copy"


def from_hf(name: str, get: Callable[[str], torch.Tensor], g: Geometry) -> torch.Tensor:
    """Full megatron tensor for canonical `name`; `get(hf_name)` returns an HF tensor (lazily, so a
    caller can read only what it needs from safetensors files)."""
    parts = [get(n) for n in hf_names(name, g)]
    kind = "copy" if name == "output_layer.weight" and g.score_outputs else _kind(name)
    if kind == "qkv":
        q, k, v = parts
        per_group = g.heads // g.groups * g.head_dim
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(g.groups, per_group, *rest), k.reshape(g.groups, g.head_dim, *rest),
                           v.reshape(g.groups, g.head_dim, *rest)], dim=1)
        return fused.reshape(-1, *rest)
    if kind == "glu":
        return torch.cat(parts, dim=0)
    tensor = parts[0]
    if kind == "vocab":
        if tensor.shape[0] != g.vocab:
            raise ValueError(f"{hf_names(name, g)[0]} has {tensor.shape[0]} rows, config vocab_size is {g.vocab}")
        padded = tensor.new_zeros(g.padded_vocab, *tensor.shape[1:])
        padded[: g.vocab] = tensor
        return padded
    return tensor


def to_hf(name: str, tensor: torch.Tensor, g: Geometry) -> dict[str, torch.Tensor]:
    """HF tensors (each owning its storage) for one full megatron tensor; {} for a tied output layer."""
    names = hf_names(name, g)
    kind = "copy" if name == "output_layer.weight" and g.score_outputs else _kind(name)
    if name == "output_layer.weight" and g.tied and not g.score_outputs:
        return {}
    if kind == "qkv":
        per_group = g.heads // g.groups * g.head_dim
        rest = tensor.shape[1:]
        grouped = tensor.reshape(g.groups, per_group + 2 * g.head_dim, *rest)
        q, k, v = grouped.split([per_group, g.head_dim, g.head_dim], dim=1)
        parts = [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    elif kind == "glu":
        parts = list(tensor.chunk(2, dim=0))
    elif kind == "vocab":
        parts = [tensor[: g.vocab]]
    else:
        parts = [tensor]
    return {n: p.clone(memory_format=torch.contiguous_format) for n, p in zip(names, parts)}


def hf_to_mcore_state(hf: dict[str, torch.Tensor], g: Geometry) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full canonical megatron state dict (TP=1, global layer indices)."""
    return {n: from_hf(n, hf.__getitem__, g) for n in mcore_names(g)}


def mcore_to_hf_state(mcore: dict[str, torch.Tensor], g: Geometry) -> dict[str, torch.Tensor]:
    """Full canonical megatron state dict -> HF state dict (tied models have no lm_head.weight)."""
    out = {}
    for n in mcore_names(g):
        out.update(to_hf(n, mcore[n], g))
    return out


def split_rule(name: str):
    """0 / 1 (split dim), "glu", or None (replicated) for a megatron parameter name."""
    return next((rule for suffix, rule in _SPLIT.items() if name.endswith(suffix)), None)


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s part of a full megatron tensor."""
    rule = split_rule(name)
    if rule is None or tp == 1:
        return full
    if rule == "glu":
        return torch.cat([_chunk(name, half, 0, tp, rank) for half in full.chunk(2, dim=0)])
    return _chunk(name, full, rule, tp, rank)


def _chunk(name: str, tensor: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    if tensor.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {tensor.shape[dim]} does not split over TP={tp}")
    return tensor.chunk(tp, dim=dim)[rank]


def unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every TP rank's part, in rank order."""
    rule = split_rule(name)
    if rule is None or len(shards) == 1:
        return shards[0]
    if rule == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=rule)
