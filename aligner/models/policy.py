"""The policy model of the sequence trainers (preference, packed SFT and RM, RL): megatron's GPTModel
reading each token's position from `position_ids`, so that packed sequences (and the branches of a
packed pair) get their own positions, with torch's fused attention on the local layer spec."""
from __future__ import annotations

from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

from aligner.models.gpt import build_gpt
from aligner.models.sdpa_attention import use_fused_attention


def with_token_positions(gpt):
    """Make a rotary GPTModel read each token's position from `position_ids` instead of its row
    position.

    megatron's GPTModel applies rotary embeddings by row position for `rope`; its `mrope` path reads
    per-token positions from `position_ids` [3, batch, seq] and uses section i of the frequencies from
    position row i. With every frequency in section 0 that is plain RoPE at the given positions
    (bitwise equal to `rope` for row positions; tests/unit/test_packing.py). The frequencies are taken over
    from the model, so Llama-3.1 scaling is kept. Rotary embeddings hold no weights: checkpoints do not
    change. Returns `gpt`."""
    if gpt.position_embedding_type != "rope":
        raise ValueError(f"explicit positions need a rotary model, got position_embedding_type="
                         f"{gpt.position_embedding_type!r}")
    rope = gpt.rotary_pos_emb
    explicit = MultimodalRotaryEmbedding(kv_channels=gpt.config.kv_channels, rotary_percent=1.0,
                                         rotary_interleaved=gpt.config.rotary_interleaved)
    explicit.inv_freq, explicit.seq_len_interpolation_factor = rope.inv_freq, rope.seq_len_interpolation_factor
    gpt.rotary_pos_emb, gpt.position_embedding_type = explicit, "mrope"
    gpt.mrope_section = [rope.inv_freq.numel(), 0, 0]
    return gpt


def build_policy(model_cfg, vocab_size: int):
    """`build_gpt` with explicit token positions and, on the local layer spec, torch's fused
    attention kernel (`aligner.models.sdpa_attention`)."""
    gpt = with_token_positions(build_gpt(model_cfg, vocab_size))
    use_fused_attention(gpt)
    return gpt
