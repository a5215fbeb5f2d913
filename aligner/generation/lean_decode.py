"""One-token decode steps for one pipeline stage of a megatron GPTModel, straight on its parameters.

Why: a decode step of a small model is dominated by Python overhead, and megatron's static
inference path also re-applies RoPE to every cached key at every step (it caches un-rotated keys).
This module runs the same Llama-family layer maths (RMSNorm, QKV, RoPE, causal attention over the
KV cache, output projection, (Swi)GLU MLP, residuals) with plain torch ops on the model's live
parameters, so an optimizer step is seen at once and nothing is copied. Tensor parallelism is
honoured (column-parallel shards local, all-reduce after the row-parallel projections, vocab
all-gather of the logits); pipeline stages run only their own layers.

KV cache: per layer [B, G_local, S, D] keys (rotated) and values, slot s = position s. The prompt
prefix is filled from megatron's `StaticInferenceContext` after megatron's own prefill
(`load_prefix`); `step` then appends one slot per call. `unsupported_reason(model)` says when a
model falls outside this maths (the engine then keeps megatron's forward for decoding).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def unsupported_reason(model) -> str | None:
    """None when `LeanDecoder` computes exactly what GPTModel.forward computes for this model."""
    c = model.config

    def flag(name, default=None):
        return getattr(c, name, default)

    checks = {
        "normalization is not RMSNorm": c.normalization != "RMSNorm",
        "position embedding is not RoPE": getattr(model, "position_embedding_type", None) != "rope",
        "interleaved RoPE": flag("rotary_interleaved"),
        "partial RoPE": flag("rotary_percent", 1.0) != 1.0,
        "multi-latent attention": flag("multi_latent_attention"),
        "mixture of experts": flag("num_moe_experts") is not None,
        "multi-token prediction": flag("mtp_num_layers") is not None,
        "linear biases (add_bias_linear)": flag("add_bias_linear"),
        "query-key layer scaling": flag("apply_query_key_layer_scaling"),
        "fp32 residual connection": flag("fp32_residual_connection"),
        "residual after layernorm": flag("apply_residual_connection_post_layernorm"),
        "zero-centred norm weights": flag("layernorm_zero_centered_gamma"),
        "sliding-window attention": flag("window_size") is not None,
        "gated attention output": flag("attention_output_gate"),
        "layers without RoPE": bool(flag("no_rope_freq")),
        "non-vanilla softmax": flag("softmax_type", "vanilla") != "vanilla",
        "fp8 / fp4": bool(flag("fp8") or flag("fp4")),
        "qk layernorm": any(_present(layer.self_attention.q_layernorm) for layer in model.decoder.layers),
        "query groups split across TP ranks": c.num_query_groups % c.tensor_model_parallel_size != 0,
        "activation other than silu/gelu": c.activation_func not in (F.silu, F.gelu),
        "context parallelism": c.context_parallel_size > 1,
    }
    reasons = [name for name, bad in checks.items() if bad]
    return ", ".join(reasons) if reasons else None


def _present(module) -> bool:
    return module is not None and type(module).__name__ != "IdentityOp"


def _norm_weight(norm, fused_linear) -> torch.Tensor:
    """A torch norm's weight, or Transformer Engine's norm fused into the next linear."""
    weight = getattr(norm, "weight", None)
    return weight if weight is not None else fused_linear.layer_norm_weight


def _bias(linear) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return bias if bias is not None and bias.numel() else None  # TE keeps an empty tensor when bias=False


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE over the whole head dim (megatron's convention): x * cos + rotate_half(x) * sin,
    computed as x * cos + roll(x, D/2) * [-sin_1, sin_2] (`signed_sin` carries the sign)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class LeanDecoder:
    """Decode state (KV cache + RoPE tables) of one generate call on one pipeline stage."""

    def __init__(self, model, layout, batch: int, max_seq: int):
        c = model.config
        self.model, self.layout, self.batch = model, layout, batch
        tp = layout.tp
        self.groups = c.num_query_groups // tp
        self.heads_per_group = c.num_attention_heads // c.num_query_groups
        self.head_dim = c.kv_channels
        self.eps = c.layernorm_epsilon
        self.gated = c.gated_linear_unit
        self.activation = c.activation_func
        self.scale = c.softmax_scale if c.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        emb = model.rotary_pos_emb(max_seq)[:, 0, 0, :]  # [S, rot_dim], as megatron's forward uses
        cos, sin = torch.cos(emb), torch.sin(emb)
        sin[:, : emb.shape[-1] // 2].neg_()  # the sign of rotate_half, folded in
        # per slot, for a group's R query heads (softmax scale folded in) and its key head: [S, R + 1, rot_dim]
        row_scale = torch.tensor([self.scale] * self.heads_per_group + [1.0], device=emb.device)[None, :, None]
        self.cos = (cos[:, None, :] * row_scale).to(self.dtype)
        self.sin = (sin[:, None, :] * row_scale).to(self.dtype)
        self.layers = [self._layer_params(layer) for layer in model.decoder.layers]
        shape = (batch, self.groups, max_seq, self.head_dim)  # slot s is written before it is ever read
        self.cache = [(torch.empty(shape, dtype=self.dtype, device=self.device),
                       torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]
        # the same memory as [B * G, S, D] batches for bmm
        self.flat = [(k.view(-1, max_seq, self.head_dim), v.view(-1, max_seq, self.head_dim)) for k, v in self.cache]
        if model.pre_process:
            embedding = model.embedding.word_embeddings
            self.embed_weight = embedding.weight
            self.vocab_range = (embedding.vocab_start_index, embedding.vocab_end_index)
        if model.post_process:
            self.final_norm = model.decoder.final_layernorm.weight
            self.output_weight = (model.shared_embedding_or_output_weight()
                                  if model.share_embeddings_and_output_weights else model.output_layer.weight)

    @staticmethod
    def _layer_params(layer) -> dict:
        attn, mlp = layer.self_attention, layer.mlp
        return {"norm1": _norm_weight(layer.input_layernorm, attn.linear_qkv),
                "qkv": attn.linear_qkv.weight, "qkv_bias": _bias(attn.linear_qkv),
                "proj": attn.linear_proj.weight,
                "norm2": _norm_weight(layer.pre_mlp_layernorm, mlp.linear_fc1),
                "fc1": mlp.linear_fc1.weight, "fc2": mlp.linear_fc2.weight}

    def load_prefix(self, context, length: int) -> None:
        """Copy slots [0, length) from megatron's static KV cache ([S, B, G, D], keys un-rotated)."""
        cos, sin = self.cos[:length, None, -1:, :], self.sin[:length, None, -1:, :]  # the key rows
        for layer, (keys, values) in zip(self.model.decoder.layers, self.cache):
            k, v = context.key_value_memory_dict[layer.self_attention.layer_number]
            keys[:, :, :length] = rope(k[:length], cos, sin).permute(1, 2, 0, 3)
            values[:, :, :length] = v[:length].permute(1, 2, 0, 3)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B] token ids -> [B, H] (vocab-parallel lookup + TP all-reduce)."""
        if self.layout.tp == 1:
            return F.embedding(tokens, self.embed_weight)
        start, end = self.vocab_range
        outside = (tokens < start) | (tokens >= end)
        hidden = F.embedding((tokens - start).masked_fill(outside, 0), self.embed_weight)
        hidden = hidden.masked_fill(outside[:, None], 0.0)
        return self.layout.tp_all_reduce(hidden)

    def step(self, hidden: torch.Tensor, slot: int) -> torch.Tensor:
        """Run this stage's layers for one token per sample at position `slot`. hidden [B, H] in,
        [B, H] out; on the last stage, full-vocabulary (padded) logits [B, V_padded] out."""
        B, G, R, D = self.batch, self.groups, self.heads_per_group, self.head_dim
        cos, sin = self.cos[slot], self.sin[slot]
        width = hidden.shape[-1]
        fp32 = self.dtype == torch.float32
        for p, (keys, values), (k_flat, v_flat) in zip(self.layers, self.cache, self.flat):
            x = F.rms_norm(hidden, (width,), p["norm1"], self.eps)
            qkv = F.linear(x, p["qkv"], p["qkv_bias"]).view(B, G, R + 2, D)
            qk = rope(qkv[:, :, : R + 1], cos, sin)  # the group's R scaled query heads and its key head
            keys[:, :, slot] = qk[:, :, R]
            values[:, :, slot] = qkv[:, :, R + 1]
            q = qk[:, :, :R].view(B * G, R, D)
            scores = torch.bmm(q, k_flat[:, : slot + 1].transpose(1, 2))
            probs = scores.softmax(-1) if fp32 else scores.float().softmax(-1).to(self.dtype)
            context = torch.bmm(probs, v_flat[:, : slot + 1]).view(B, G * R * D)
            hidden = hidden + self.layout.tp_all_reduce(F.linear(context, p["proj"]))
            x = F.rms_norm(hidden, (width,), p["norm2"], self.eps)
            x = F.linear(x, p["fc1"])
            if self.gated:
                gate, up = x.chunk(2, dim=-1)
                x = self.activation(gate) * up
            else:
                x = self.activation(x)
            hidden = hidden + self.layout.tp_all_reduce(F.linear(x, p["fc2"]))
        if not self.model.post_process:
            return hidden
        x = F.rms_norm(hidden, (width,), self.final_norm, self.eps)
        return self.layout.tp_all_gather_last(F.linear(x, self.output_weight))
