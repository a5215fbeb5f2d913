"""The fused rotary embedding (aligner.models.rope) against megatron's own unfused implementation:
bitwise-equal outputs and input gradients, the cached tables, the cases handed back to megatron,
and a whole GPTModel's logits and gradients with and without it (one process)."""
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from aligner.models import rope
from tests.conftest import build_single_process_gpt


def _freqs(s: int, d: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Angles [s, batch, 1, d] as megatron builds them: d/2 frequencies, repeated twice."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 500, (s, batch, 1, 1), generator=g).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = positions * inv_freq
    return torch.cat([angles, angles], dim=-1)


def _config(**overrides):
    flags = dict(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    return SimpleNamespace(**{**flags, **overrides})


@pytest.mark.parametrize("dtype,batch", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 3)])
def test_equals_megatron_forward_and_backward(dtype, batch):
    s, heads, d = 7, 4, 16
    freqs = _freqs(s, d, batch)
    x = torch.randn(s, 3, heads, d).to(dtype).requires_grad_()
    ours = rope.apply_rope(x, freqs)
    theirs = _apply_rotary_pos_emb_bshd(x, freqs)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    weights = torch.randn(ours.shape).to(dtype)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), x)
    (g_theirs,) = torch.autograd.grad((theirs * weights).sum(), x)
    assert torch.equal(g_ours, g_theirs)


def test_tables_are_computed_once_per_frequency_tensor():
    freqs = _freqs(5, 8)
    cos, signed_sin = rope.rope_tables(freqs, torch.float32)
    assert rope.rope_tables(freqs, torch.float32)[0] is cos  # the same forward: reused
    assert torch.equal(cos, freqs.cos())
    assert torch.equal(signed_sin[..., :4], -freqs.sin()[..., :4]) and torch.equal(signed_sin[..., 4:], freqs.sin()[..., 4:])
    other = freqs + 1.0  # a new forward's tensor: new tables
    assert torch.equal(rope.rope_tables(other, torch.float32)[0], other.cos())
    assert rope.rope_tables(other, torch.bfloat16)[0].dtype == torch.bfloat16


def test_other_cases_go_to_megatron(monkeypatch):
    calls = []
    monkeypatch.setattr(rope, "_original", lambda *args, **kwargs: calls.append(kwargs) or "megatron")
    x, freqs = torch.randn(4, 1, 2, 8), _freqs(4, 8)
    for config, kwargs in [(_config(rotary_interleaved=True), {}), (_config(apply_rope_fusion=True), {}),
                           (_config(multi_latent_attention=True), {}), (_config(), {"mscale": 0.5}),
                           (_config(), {"cu_seqlens": torch.tensor([0, 4])})]:
        assert rope.apply_rotary_pos_emb(x, freqs, config, **kwargs) == "megatron"
    assert rope.apply_rotary_pos_emb(x[..., :6], freqs, _config()) == "megatron"  # partial rotary
    assert len(calls) == 6
    assert torch.equal(rope.apply_rotary_pos_emb(x, freqs, _config()), _apply_rotary_pos_emb_bshd(x, freqs))


def test_gpt_model_unchanged(monkeypatch):
    """Logits and every parameter gradient of a GPTModel (explicit positions, as packed batches run
    it) are bitwise those of megatron's own rotary code."""
    from megatron.core.transformer import attention

    model = build_single_process_gpt(3, policy=True, num_query_groups=2)
    assert attention.apply_rotary_pos_emb is rope.apply_rotary_pos_emb  # installed by build_gpt
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([list(range(12)), list(range(5)) + list(range(7))]).expand(3, -1, -1)

    def run():
        model.zero_grad()
        logits = model(tokens, positions, None)
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = run()
    monkeypatch.setattr(attention, "apply_rotary_pos_emb", rope._original)
    theirs = run()
    assert torch.equal(ours[0], theirs[0])
    assert all(torch.equal(ours[1][n], theirs[1][n]) for n in ours[1])
