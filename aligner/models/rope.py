"""Rotary embeddings applied with one fused autograd op and tables computed once per forward.

megatron's unfused `apply_rotary_pos_emb` (the path of the local layer spec, i.e. every CPU run)
recomputes cos and sin of the frequencies for the queries and again for the keys of every layer,
builds `rotate_half` with a negation and a concatenation, and ends with a concatenation of an
empty pass-through part: ~10 ops forward and as many backward per tensor. Here the same maths is
    y = x * cos + roll(x, D/2) * [-sin_1, sin_2]   (rotate_half(x) * sin, the sign folded in)
    dx = g * cos + roll(g * [-sin_1, sin_2], D/2)  (rolling by half the dim is its own inverse)
with the (cos, signed sin) tables cached for the frequency tensor of the current forward (GPTModel
passes one tensor to every layer, for queries and keys alike). Results equal megatron's bitwise.

`install_fused_rope()` points megatron's attention module at `apply_rotary_pos_emb` below, which takes the
plain case (whole-head, non-interleaved RoPE on [s, b, heads, d] without packed `cu_seqlens`,
mscale 1, no Transformer-Engine fusion) and hands every other case to megatron's own function.
"""
from __future__ import annotations

import torch

# megatron's attention module is imported inside install_fused_rope: models.gpt imports this module, and
# the CLI process imports gpt before it launches ranks.

_original = None
_last: tuple | None = None  # (freqs, dtype, cos, signed_sin) of the latest forward


def cos_and_signed_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of angles `freqs` [..., D], the first half of sin negated (rotate_half's sign)."""
    cos, sin = freqs.cos(), freqs.sin()
    sin[..., : freqs.shape[-1] // 2].neg_()
    return cos, sin


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos_and_signed_sin(freqs)` in `dtype`, computed once for the latest frequency tensor."""
    global _last
    if _last is None or _last[0] is not freqs or _last[1] != dtype:
        _last = (freqs, dtype, *(t.to(dtype) for t in cos_and_signed_sin(freqs)))
    return _last[2], _last[3]


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, signed_sin):
        ctx.save_for_backward(cos, signed_sin)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin  # not addcmul: it fuses, and rounds differently

    @staticmethod
    def backward(ctx, grad):
        cos, signed_sin = ctx.saved_tensors
        return grad * cos + (grad * signed_sin).roll(grad.shape[-1] // 2, dims=-1), None, None


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE over the whole last dim of x [s, b, heads, d] at angles freqs [s, b|1, 1, d]."""
    cos, signed_sin = rope_tables(freqs, x.dtype)
    return _Rope.apply(x, cos, signed_sin)


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """megatron's `apply_rotary_pos_emb` signature; the plain case fused, the rest delegated."""
    plain = (cu_seqlens is None and mscale == 1.0 and not config.apply_rope_fusion and not config.rotary_interleaved
             and not config.multi_latent_attention and torch.is_tensor(freqs) and freqs.shape[-1] == t.shape[-1])
    if plain:
        return apply_rope(t, freqs)
    return _original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)


def install_fused_rope() -> None:
    """Route megatron's attention layers through `apply_rotary_pos_emb` (once per process)."""
    global _original
    from megatron.core.transformer import attention  # megatron: see the note at the top

    if attention.apply_rotary_pos_emb is not apply_rotary_pos_emb:
        _original = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = apply_rotary_pos_emb
