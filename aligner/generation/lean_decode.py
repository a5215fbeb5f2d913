"""Prefill and one-token decode steps for one pipeline stage of a megatron GPTModel, on its parameters.

Why: a decode step of a small model is dominated by per-op overhead, and megatron's static inference
path re-applies RoPE to every cached key at every step (it caches un-rotated keys) and runs its
prefill through modules built for training. This module runs the same Llama-family layer maths
(RMSNorm, QKV, RoPE, causal attention, output projection, (Swi)GLU MLP, residuals) with plain torch
ops on the model's live parameters, so an optimizer step is seen at once and nothing is copied.
Tensor parallelism is honoured (column-parallel shards local, all-reduce after the row-parallel
projections, vocab all-gather of the logits); pipeline stages run only their own layers. Context
parallelism needs nothing: a CP rank holds its TP shard's whole weights, and the decoder attends over
its own whole cache (no CP collective), so each CP rank generates whole sequences, as a replica.

KV cache: per layer [B, G_local, C, D] keys (rotated) and values, slot s = position s, zero-filled.
`forward` at slot 0 is the prefill (causal attention over the prompt prefix, which fills slots
[0, L)); every later call is one decode step that writes its slot in place and attends over the
cache's whole capacity C, the slots not written yet masked out by an additive -inf bias. Why the
whole capacity and not the written prefix: a prefix slice of every (sample, head) matrix is a
gapped read that the CPU streams about twice as slowly as the contiguous cache (measured on a
batch-32 step), and the masked slots cost a few more multiply-adds. The capacity doubles (a copy)
when a step reaches it, so it stays within twice the written length.

`compiled=True` runs the decode steps' layers through torch.compile (Inductor) instead: the same
function (`run_layers`), with an attention written as products and sums that Inductor fuses into
loops. A decode step of a small model is mostly small ops, and fusing them is what makes it faster
(on the 2-core CPU, batch 32: 1.7 ms a step against 2.1 ms). The first step of a new batch size or
capacity compiles (seconds); the prefill stays eager. Tensor parallelism is not compiled: its
all-reduces sit between the layers' ops.
`unsupported_reason(model)` says when a model falls outside this maths (the engine then keeps
megatron's forward).
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from aligner.errors import UserError
from aligner.models.lora import merged_weight
from aligner.models.rope import cos_and_signed_sin

def unsupported_reason(model) -> str | None:
    """None when `LeanDecoder` computes exactly what GPTModel.forward computes for this model."""
    c = model.config

    def flag(name, default=None):
        return getattr(c, name, default)

    checks = {
        "normalization is not RMSNorm": c.normalization != "RMSNorm",
        "position embedding is not RoPE": not _plain_rope(model),
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
    }
    reasons = [name for name, bad in checks.items() if bad]
    return ", ".join(reasons) if reasons else None


def _plain_rope(model) -> bool:
    """RoPE by row position, or at explicit positions with every frequency in the first section (the
    policy models of `aligner.models.policy.with_token_positions`: plain RoPE)."""
    kind = getattr(model, "position_embedding_type", None)
    return kind == "rope" or (kind == "mrope" and not any(getattr(model, "mrope_section", [0, 1])[1:]))


class _OneRank:
    """A stand-in context-parallel group of one rank (megatron's rotary modules ask only its size): under
    context parallelism they would return this CP rank's chunks of the table, and the decoder needs all of it."""

    @staticmethod
    def size() -> int:
        return 1


_ONE_RANK = _OneRank()  # one object: RotaryEmbedding.forward's lru_cache keys on it


def rotary_table(model, max_seq: int) -> torch.Tensor:
    """[max_seq, rot_dim] rotary angles of slots 0..max_seq-1, as megatron's forward computes them (the
    whole table, also under context parallelism: the decoder runs whole sequences)."""
    if model.position_embedding_type == "mrope":
        slots = torch.arange(max_seq, device=model.rotary_pos_emb.inv_freq.device).expand(3, 1, -1)
        return model.rotary_pos_emb(slots, model.mrope_section, cp_group=_ONE_RANK)[:, 0, 0, :]
    return model.rotary_pos_emb(max_seq, cp_group=_ONE_RANK)[:, 0, 0, :]


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


@dataclass(frozen=True)
class LayerDims:
    """What the layer maths needs to know of the model, per TP rank."""
    width: int  # hidden size
    groups: int  # query groups on this rank
    heads_per_group: int
    head_dim: int
    eps: float
    gated: bool  # (Swi)GLU: fc1 holds [gate; up]
    activation: Callable


def run_layers(hidden, slots, cos, sin, bias, layers, caches, dims: LayerDims, attend, project):
    """Layers on hidden [B * s, H] (s tokens per sample) at cache slots `slots` [s] -> [B * s, H].
    Writes each layer's rotated keys and values into its cache; `attend(q [B, s, G, R, D] (scaled),
    keys, values, bias) -> [B * s, G * R * D]`; `project(hidden, x, weight)` = hidden + x @ weight.T
    summed over TP. cos / sin: [s, 1, R + 1, D] (softmax scale folded into the R query rows)."""
    s = slots.shape[0]
    B = hidden.shape[0] // s
    G, R, D = dims.groups, dims.heads_per_group, dims.head_dim
    for p, (keys, values) in zip(layers, caches):
        x = F.rms_norm(hidden, (dims.width,), p["norm1"], dims.eps)
        qkv = F.linear(x, p["qkv"], p["qkv_bias"]).view(B, s, G, R + 2, D)
        qk = rope(qkv[..., : R + 1, :], cos, sin)  # the group's R scaled query heads and its key head
        keys.index_copy_(2, slots, qk[..., R, :].transpose(1, 2))
        values.index_copy_(2, slots, qkv[..., R + 1, :].transpose(1, 2))
        hidden = project(hidden, attend(qk[..., :R, :], keys, values, bias), p["proj"])
        x = F.linear(F.rms_norm(hidden, (dims.width,), p["norm2"], dims.eps), p["fc1"])
        if dims.gated:
            gate, up = x.chunk(2, dim=-1)
            x = dims.activation(gate) * up
        else:
            x = dims.activation(x)
        hidden = project(hidden, x, p["fc2"])
    return hidden


def attend_prefix(q, keys, values, bias):
    """Causal attention of q [B, s, G, R, D] (scaled) over cache slots [0, s) -> [B * s, G * R * D]."""
    B, s, G, R, D = q.shape
    q = q.permute(0, 2, 3, 1, 4).reshape(B, G * R, s, D)
    k, v = (t[:, :, None, :s].expand(B, G, R, s, D).reshape(B, G * R, s, D) for t in (keys, values))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    return out.transpose(1, 2).reshape(B * s, G * R * D)


def attend_step(q, keys, values, bias):
    """One query position q [B, 1, G, R, D] (scaled) over the cache's whole capacity (unwritten slots
    masked by `bias` [C]) -> [B, G * R * D]. In fp32, batched matrix products over B * G: in eager mode they
    beat SDPA's kernels on CPU. In bf16 / fp16, SDPA, each group's R query heads as R queries over its cache:
    its kernels keep the scores in fp32, as the trainer's attention does (a product's bf16 output would round
    them: 0.10 off in the output at scores of ~70, against 0.008 from rounding the output alone)."""
    B, _, G, R, D = q.shape
    if q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q[:, 0], keys, values, attn_mask=bias[None], scale=1.0).reshape(
            B, G * R * D)
    C = keys.shape[2]
    k_flat, v_flat = keys.view(B * G, C, D), values.view(B * G, C, D)  # the caches' own memory
    scores = torch.baddbmm(bias.expand(B * G, R, C), q.reshape(B * G, R, D), k_flat.transpose(1, 2))
    return torch.bmm(scores.softmax(-1), v_flat).view(B, G * R * D)


def attend_step_fused(q, keys, values, bias):
    """`attend_step` as broadcast products and sums, which Inductor turns into one pass over each cache
    (no [B * G] batch of tiny matrix products); in eager mode this is slower."""
    B, _, G, R, D = q.shape
    scores = (q[:, 0, :, :, None, :].float() * keys[:, :, None].float()).sum(-1) + bias.float()  # [B, G, R, C], fp32
    probs = scores.softmax(-1).to(q.dtype)
    return (probs[..., None] * values[:, :, None]).sum(3).reshape(B, G * R * D)


def _addmm_projection(hidden, x, weight):
    return torch.addmm(hidden, x, weight.t())  # the residual add fused into the product


_compiled_layers = {}  # device type -> run_layers under torch.compile (one per process: its graphs are cached)
MAX_COMPILED_SHAPES = 32  # graphs per process and device; steps of further shapes run eagerly


def compiled_run_layers(device: torch.device):
    """run_layers compiled for `device`, one graph per input shape (static shapes: on the 2-core CPU a
    graph with a symbolic batch size gave up most of the gain), with its C++ wrapper on CPU (fewer
    Python calls per step). Past MAX_COMPILED_SHAPES shapes, new ones run eagerly instead of compiling."""
    if device.type not in _compiled_layers:
        if device.type == "cpu" and shutil.which("g++") is None and shutil.which("c++") is None:
            raise UserError("decode='compiled' on CPU needs a C++ compiler (torch.compile's Inductor builds its "
                            "kernels with it), and there is no g++ or c++ on PATH", "generation.decode / decode=",
                            "install g++ (apt-get install g++), or use decode=lean")
        options = {"cpp_wrapper": True} if device.type == "cpu" else None
        compiled = torch.compile(run_layers, fullgraph=True, dynamic=False, options=options)
        shapes = set()

        def run(hidden, slots, cos, sin, bias, layers, caches, dims, attend, project):
            args = (hidden, slots, cos, sin, bias, layers, caches, dims, attend, project)
            shape = (hidden.shape, caches[0][0].shape, hidden.dtype, len(layers), dims)
            if shape not in shapes and len(shapes) >= MAX_COMPILED_SHAPES:
                return run_layers(*args)
            shapes.add(shape)
            with torch._dynamo.config.patch(recompile_limit=2 * MAX_COMPILED_SHAPES):  # ours decides first
                return compiled(*args)
        _compiled_layers[device.type] = run
    return _compiled_layers[device.type]


class LeanDecoder:
    """Decode state (KV cache + RoPE tables) of one generate call on one pipeline stage."""

    def __init__(self, model, layout, batch: int, max_seq: int, compiled: bool = False):
        """compiled: decode steps through `compiled_run_layers` (TP=1; MegatronEngine checks it)."""
        c = model.config
        self.model, self.layout, self.batch = model, layout, batch
        self.dims = LayerDims(width=c.hidden_size, groups=c.num_query_groups // layout.tp,
                              heads_per_group=c.num_attention_heads // c.num_query_groups,
                              head_dim=c.kv_channels, eps=c.layernorm_epsilon, gated=c.gated_linear_unit,
                              activation=c.activation_func)
        R, D = self.dims.heads_per_group, self.dims.head_dim
        scale = c.softmax_scale if c.softmax_scale is not None else 1.0 / math.sqrt(D)
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        self.compiled_layers = compiled_run_layers(self.device) if compiled else None
        self.project = _addmm_projection if layout.tp == 1 else self._tp_projection
        emb = rotary_table(model, max_seq)  # [S, rot_dim]
        cos, sin = cos_and_signed_sin(emb)
        # per slot, for a group's R query heads (softmax scale folded in) and its key head: [S, 1, R + 1, rot_dim]
        row_scale = torch.tensor([scale] * R + [1.0], device=emb.device)[None, :, None]
        self.cos = (cos[:, None, :] * row_scale).to(self.dtype)[:, None]
        self.sin = (sin[:, None, :] * row_scale).to(self.dtype)[:, None]
        self.slots = torch.arange(max_seq, device=self.device)
        self.layers = [self._layer_params(layer) for layer in model.decoder.layers]
        self.max_seq = max_seq
        self.cache, self.bias = [], None
        self._grow(self._capacity(1))
        if model.pre_process:
            embedding = model.embedding.word_embeddings
            self.embed_weight = embedding.weight
            self.vocab_range = (embedding.vocab_start_index, embedding.vocab_end_index)
        if model.post_process:
            self.final_norm = model.decoder.final_layernorm.weight
            self.output_weight = (model.shared_embedding_or_output_weight()
                                  if model.share_embeddings_and_output_weights else model.output_layer.weight)

    def _capacity(self, slots: int) -> int:
        """Cache capacity for `slots` written slots: the smallest 64 * 2**k that holds them, at most the
        call's max_seq (a compiled decoder rounds that up to a multiple of 16: fewer shapes to compile)."""
        capacity = 64
        while capacity < slots:
            capacity *= 2
        limit = self.max_seq if self.compiled_layers is None else -(-self.max_seq // 16) * 16
        return min(limit, capacity)

    def _grow(self, capacity: int) -> None:
        """Reallocate the KV cache with `capacity` slots (zeros: masked slots must hold finite values,
        since their attention weight 0 multiplies them), keeping the slots written so far."""
        shape = (self.batch, self.dims.groups, capacity, self.dims.head_dim)
        old = self.cache
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]
        for (k_new, v_new), (k_old, v_old) in zip(self.cache, old):
            k_new[:, :, : k_old.shape[2]] = k_old
            v_new[:, :, : v_old.shape[2]] = v_old
        bias = torch.full((capacity,), float("-inf"), dtype=self.dtype, device=self.device)
        if self.bias is not None:
            bias[: self.bias.shape[0]] = self.bias
        self.bias = bias

    @staticmethod
    def _layer_params(layer) -> dict:
        """The layer's weights; a linear with LoRA adapters gives its merged weight W + scale B A, made
        once for this generate call (the trainer's W is untouched; README, LoRA, says why merged)."""
        attn, mlp = layer.self_attention, layer.mlp
        return {"norm1": _norm_weight(layer.input_layernorm, attn.linear_qkv),
                "qkv": merged_weight(attn.linear_qkv), "qkv_bias": _bias(attn.linear_qkv),
                "proj": merged_weight(attn.linear_proj),
                "norm2": _norm_weight(layer.pre_mlp_layernorm, mlp.linear_fc1),
                "fc1": merged_weight(mlp.linear_fc1), "fc2": merged_weight(mlp.linear_fc2)}

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
        if s > 1 and slot != 0:
            raise ValueError(f"several tokens per sample ({s}) are only supported at slot 0 (the prefill)")
        end = slot + s
        if end > self.cache[0][0].shape[2]:
            self._grow(self._capacity(end))
        self.bias[slot:end] = 0.0  # these slots are attended from now on
        if s > 1:
            layers, attend = run_layers, attend_prefix
        elif self.compiled_layers is not None:
            layers, attend = self.compiled_layers, attend_step_fused
        else:
            layers, attend = run_layers, attend_step
        hidden = layers(hidden.reshape(B * s, width), self.slots[slot:end], self.cos[slot:end], self.sin[slot:end],
                        self.bias, self.layers, self.cache, self.dims, attend, self.project)
        if not self.model.post_process:
            return hidden.view(B, s, width)
        x = F.rms_norm(hidden.view(B, s, width)[:, -1], (width,), self.final_norm, self.dims.eps)
        return self.layout.tp_all_gather_last(F.linear(x, self.output_weight))

    def _tp_projection(self, hidden, x, weight):
        """hidden + x @ weight.T for a row-parallel projection, summed over TP before the residual add."""
        return hidden + self.layout.tp_all_reduce(F.linear(x, weight))
