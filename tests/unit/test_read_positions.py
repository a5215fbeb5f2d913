"""The final layer's MLP on the read positions only (`aligner.models.read_positions`): the outputs at
those positions and every gradient equal the full forward's, and the MLP sees only those rows (one
process)."""
import contextlib

import pytest
import torch

from aligner.models.read_positions import masked_rows, read_only
from tests.conftest import build_single_process_gpt


def _gpt(head: str):
    from aligner.models.heads import attach_scalar_head

    gpt = build_single_process_gpt(11)
    return attach_scalar_head(gpt, 2) if head == "reward" else gpt


def _fc1_rows(gpt, run) -> int:
    """How many positions the final layer's first MLP projection computed during `run()`."""
    seen = []
    handle = gpt.decoder.layers[-1].mlp.linear_fc1.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[:-1].numel()))
    try:
        out = run()
    finally:
        handle.remove()
    return out, sum(seen)


def _loss_and_grads(gpt, tokens, mask, weights, rows=None):
    gpt.zero_grad(set_to_none=True)

    def run():
        if rows is None:
            return gpt(tokens, None, None)
        with read_only(gpt, rows):
            return gpt(tokens, None, None)

    out, fc1_rows = _fc1_rows(gpt, run)
    loss = (out * weights * mask[..., None]).sum()  # only the masked positions are read
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters()}, fc1_rows


@pytest.mark.parametrize("head", ["lm", "reward"])
def test_read_positions_give_the_full_forward_outputs_and_gradients(head):
    gpt = _gpt(head)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 300, (3, 10), generator=generator)
    if head == "reward":  # a reward model reads one position per sequence, its last token
        mask = torch.zeros(3, 10)
        mask[torch.arange(3), torch.tensor([9, 4, 6])] = 1.0
    else:  # a language-model loss reads the labelled positions
        mask = (torch.rand(3, 10, generator=generator) < 0.4).float()
    weights = torch.randn(3, 10, 1, generator=generator)

    full, full_grads, full_rows = _loss_and_grads(gpt, tokens, mask, weights)
    part, part_grads, part_rows = _loss_and_grads(gpt, tokens, mask, weights, masked_rows(mask))

    assert full_rows == 30 and part_rows == int(mask.sum()) < 30
    read = mask.bool()
    assert torch.allclose(part[read], full[read], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(part[~read], full[~read])  # the unread positions really were skipped
    for name, grad in full_grads.items():  # equal up to fp32 summation order, which differs by CPU (AVX2/AVX-512)
        atol = 1e-6 * max(1.0, grad.abs().max().item())
        assert torch.allclose(part_grads[name], grad, atol=atol, rtol=1e-5), name


def test_no_read_rows_and_the_cases_left_alone():
    gpt = _gpt("reward")
    tokens = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(4))
    with read_only(gpt, masked_rows(torch.zeros(2, 6))):  # e.g. a CP rank holding no last token
        out = gpt(tokens, None, None)
    assert out.shape == (2, 6, 2) and torch.isfinite(out).all()

    gpt.config.sequence_parallel = True  # the MLP's input would be split along the sequence
    try:
        def run():
            with read_only(gpt, torch.tensor([0])):
                return gpt.decoder.layers[-1].mlp(torch.randn(6, 2, gpt.config.hidden_size))

        _, rows = _fc1_rows(gpt, run)
        assert rows == 12
    finally:
        gpt.config.sequence_parallel = False


def test_masked_rows_are_position_major():
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])  # [b, s]; megatron's hidden states are [s, b]
    assert masked_rows(mask).tolist() == [1, 2, 4]  # (t=0, i=1), (t=1, i=0), (t=2, i=0)


@pytest.mark.parametrize("units", ["pairs", "samples"])
def test_flat_packed_row_reads_only_its_masked_positions(units):
    """A flat packed row (pair trees, or RL's samples: a causal block each, attended in grouped calls):
    the final layer's attention output, output projection and MLP run on the loss-masked positions only;
    outputs there and gradients equal."""
    from aligner.models.policy import build_policy
    from aligner.config.schema import ModelConfig
    from aligner.data.packing import build_micro_batches
    from aligner.models.sdpa_attention import BlockDiagonalMask
    from omegaconf import OmegaConf

    _gpt("lm")  # process group
    torch.manual_seed(12)
    gpt = build_policy(OmegaConf.structured(ModelConfig), 300)
    g = torch.Generator().manual_seed(5)
    pairs = []
    for _ in range(3):
        prompt = torch.randint(3, 300, (4,), generator=g).tolist()
        pairs.append([(prompt + torch.randint(3, 300, (n,), generator=g).tolist(), [0] * 4 + [1] * n) for n in (5, 3)])
    group = [p[0] for p in pairs] + [p[1] for p in pairs]
    if units == "pairs":
        (batch,), length = build_micro_batches([group], 0, packed=True, capacity=12, pairs=True, flat=True)
    else:  # each sequence a bin, so a causal block of its own
        (batch,), length = build_micro_batches([group], 0, packed=True, flat=True, multiple=16)
    assert len(batch["blocks"]) > 2  # several attention blocks
    mask = BlockDiagonalMask.from_tree(batch["segments"], batch["parents"], batch["blocks"])
    assert all(allowed is None for allowed in mask.allowed) == (units == "samples")
    positions = batch["position_ids"].unsqueeze(0).expand(3, -1, -1)
    loss_mask = batch["loss_mask"]
    weights = torch.randn(1, length, 1, generator=g)
    core = gpt.decoder.layers[-1].self_attention.core_attention
    attended = []
    handle = core.register_forward_hook(lambda module, args, out: attended.append(out.shape[0]))

    def run(rows):
        gpt.zero_grad(set_to_none=True)
        with read_only(gpt, rows) if rows is not None else contextlib.nullcontext():
            out = gpt(batch["tokens"], positions, mask)
        (out * weights * loss_mask[..., None]).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters()}

    try:
        full, full_grads = run(None)
        part, part_grads = run(masked_rows(loss_mask))
    finally:
        handle.remove()
    assert attended == [length, int(loss_mask.sum())]
    read = loss_mask.bool()
    assert torch.allclose(part[read], full[read], atol=1e-6, rtol=1e-5)
    for name, grad in full_grads.items():  # equal up to fp32 summation order, which differs by CPU (AVX2/AVX-512)
        atol = 1e-6 * max(1.0, grad.abs().max().item())
        assert torch.allclose(part_grads[name], grad, atol=atol, rtol=1e-5), name
