"""Prefill and one-token decode steps for one pipeline stage of a megatron GPTModel, on its parameters.

Why: a decode step of a small model is dominated by per-op overhead, and megatron's static inference
path re-applies RoPE to every cached key at every step (it caches un-rotated keys) and runs its
prefill through modules built for training. This module runs the same Llama-family layer maths
(RMSNorm, QKV, RoPE, causal attention, output projection, (Swi)GLU MLP, residuals) with plain torch
ops on the model's live parameters, so an optimizer step is seen at once and nothing is copied.
Tensor parallelism is honoured (column-parallel shards local, all-reduce after the row-parallel
projections, vocab all-gather of the logits); pipeline stages run only their own layers.

KV cache: per layer [B, G_local, C, D] keys (rotated) and values, slot s = position s, zero-filled.
`forward` at slot 0 is the prefill (causal attention over the prompt prefix, which fills slots
[0, L)); every later call is one decode step that writes its slot in place and attends over the
cache's whole capacity C, the slots not written yet masked out by an additive -inf bias. Why the
whole capacity and not the written prefix: a prefix slice of every (sample, head) matrix is a
gapped read that the CPU streams about twice as slowly as the contiguous cache (measured on a
batch-32 step), and the masked slots cost a few more multiply-adds. The capacity doubles (a copy)
when a step reaches it, so it stays within twice the written length.
`unsupported_reason(model)` says when a model falls outside this maths (the engine then keeps
megatron's forward).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from aligner.models.rope import cos_and_signed_sin

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
        self.groups = c.num_query_groups // layout.tp
        self.heads_per_group = c.num_attention_heads // c.num_query_groups
        self.head_dim = c.kv_channels
        self.eps = c.layernorm_epsilon
        self.gated = c.gated_linear_unit
        self.activation = c.activation_func
        self.scale = c.softmax_scale if c.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        emb = model.rotary_pos_emb(max_seq)[:, 0, 0, :]  # [S, rot_dim], as megatron's forward uses
        cos, sin = cos_and_signed_sin(emb)
        # per slot, for a group's R query heads (softmax scale folded in) and its key head: [S, R + 1, rot_dim]
        row_scale = torch.tensor([self.scale] * self.heads_per_group + [1.0], device=emb.device)[None, :, None]
        self.cos = (cos[:, None, :] * row_scale).to(self.dtype)
        self.sin = (sin[:, None, :] * row_scale).to(self.dtype)
        self.layers = [self._layer_params(layer) for layer in model.decoder.layers]
        self.max_seq = max_seq
        self.cache, self.flat, self.bias = [], [], None
        self._grow(min(max_seq, 64))
        if model.pre_process:
            embedding = model.embedding.word_embeddings
            self.embed_weight = embedding.weight
            self.vocab_range = (embedding.vocab_start_index, embedding.vocab_end_index)
        if model.post_process:
            self.final_norm = model.decoder.final_layernorm.weight
            self.output_weight = (model.shared_embedding_or_output_weight()
                                  if model.share_embeddings_and_output_weights else model.output_layer.weight)

    def _grow(self, capacity: int) -> None:
        """Reallocate the KV cache with `capacity` slots (zeros: masked slots must hold finite values,
        since their attention weight 0 multiplies them), keeping the slots written so far."""
        shape = (self.batch, self.groups, capacity, self.head_dim)
        old = self.cache
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]
        for (k_new, v_new), (k_old, v_old) in zip(self.cache, old):
            k_new[:, :, : k_old.shape[2]] = k_old
            v_new[:, :, : v_old.shape[2]] = v_old
        # the same memory as [B * G, C, D] batches for bmm
        self.flat = [(k.view(-1, capacity, self.head_dim), v.view(-1, capacity, self.head_dim)) for k, v in self.cache]
        bias = torch.full((capacity,), float("-inf"), dtype=self.dtype, device=self.device)
        if self.bias is not None:
            bias[: self.bias.shape[0]] = self.bias
        self.bias = bias

    @staticmethod
    def _layer_params(layer) -> dict:
        attn, mlp = layer.self_attention, layer.mlp
        return {"norm1": _norm_weight(layer.input_layernorm, attn.linear_qkv),
                "qkv": attn.linear_qkv.weight, "qkv_bias": _bias(attn.linear_qkv),
                "proj": attn.linear_proj.weight,
                "norm2": _norm_weight(layer.pre_mlp_layernorm, mlp.linear_fc1),
                "fc1": mlp.linear_fc1.weight, "fc2": mlp.linear_fc2.weight}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, s] token ids -> [B, s, H] (vocab-parallel lookup + TP all-reduce)."""
        if self.layout.tp == 1:
            return F.embedding(tokens, self.embed_weight)
        start, end = self.vocab_range
        outside = (tokens < start) | (tokens >= end)
        hidden = F.embedding((tokens - start).masked_fill(outside, 0), self.embed_weight)
        hidden = hidden.masked_fill(outside[..., None], 0.0)
        return self.layout.tp_all_reduce(hidden)

    def forward(self, hidden: torch.Tensor, slot: int) -> torch.Tensor:
        """Run this stage's layers on hidden [B, s, H] at slots [slot, slot + s): the prefill (slot 0)
        or one decode step (s = 1). Returns [B, s, H], or on the last stage the full-vocabulary (padded)
        logits [B, V_padded] of the last slot."""
        B, s, width = hidden.shape
        G, R, D = self.groups, self.heads_per_group, self.head_dim
        if s > 1 and slot != 0:
            raise ValueError(f"several tokens per sample ({s}) are only supported at slot 0 (the prefill)")
        end = slot + s
        capacity = self.cache[0][0].shape[2]
        if end > capacity:
            self._grow(min(self.max_seq, max(end, 2 * capacity)))
        self.bias[slot:end] = 0.0  # these slots are attended from now on
        cos, sin = self.cos[slot:end, None], self.sin[slot:end, None]  # [s, 1, R + 1, D]
        hidden = hidden.reshape(B * s, width)  # rows of 2-D matrix products from here on
        for p, (keys, values), flat in zip(self.layers, self.cache, self.flat):
            x = F.rms_norm(hidden, (width,), p["norm1"], self.eps)
            qkv = F.linear(x, p["qkv"], p["qkv_bias"]).view(B, s, G, R + 2, D)
            qk = rope(qkv[..., : R + 1, :], cos, sin)  # the group's R scaled query heads and its key head
            keys[:, :, slot:end] = qk[..., R, :].transpose(1, 2)
            values[:, :, slot:end] = qkv[..., R + 1, :].transpose(1, 2)
            q = qk[..., :R, :]
            context = self._attend_step(q, flat) if s == 1 else self._attend_prefix(q, keys, values, s)
            hidden = self._add_projection(hidden, context, p["proj"])
            x = F.linear(F.rms_norm(hidden, (width,), p["norm2"], self.eps), p["fc1"])
            if self.gated:
                gate, up = x.chunk(2, dim=-1)
                x = self.activation(gate) * up
            else:
                x = self.activation(x)
            hidden = self._add_projection(hidden, x, p["fc2"])
        if not self.model.post_process:
            return hidden.view(B, s, width)
        x = F.rms_norm(hidden.view(B, s, width)[:, -1], (width,), self.final_norm, self.eps)
        return self.layout.tp_all_gather_last(F.linear(x, self.output_weight))

    def _add_projection(self, hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """hidden + x @ weight.T for a row-parallel projection (summed over TP before the residual add).
        Without TP the add is fused into the matrix product (one op instead of two)."""
        if self.layout.tp == 1:
            return torch.addmm(hidden, x, weight.t())
        return hidden + self.layout.tp_all_reduce(F.linear(x, weight))

    def _attend_step(self, q: torch.Tensor, flat) -> torch.Tensor:
        """q [B, 1, G, R, D] (scaled) over the written cache slots -> context [B, G * R * D]. Batched
        matrix products over B * G: for one query position they beat SDPA's kernels on CPU."""
        B, _, G, R, D = q.shape
        k_flat, v_flat = flat
        scores = torch.baddbmm(self.bias.expand(B * G, R, -1), q.reshape(B * G, R, D), k_flat.transpose(1, 2))
        probs = scores.softmax(-1) if self.dtype == torch.float32 else scores.float().softmax(-1).to(self.dtype)
        return torch.bmm(probs, v_flat).view(B, G * R * D)

    def _attend_prefix(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: int) -> torch.Tensor:
        """Causal attention of q [B, s, G, R, D] (scaled) over cache slots [0, s) -> [B * s, G * R * D]."""
        B, _, G, R, D = q.shape
        q = q.permute(0, 2, 3, 1, 4).reshape(B, G * R, s, D)
        k, v = (t[:, :, None, :s].expand(B, G, R, s, D).reshape(B, G * R, s, D) for t in (keys, values))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        return out.transpose(1, 2).reshape(B * s, G * R * D)
