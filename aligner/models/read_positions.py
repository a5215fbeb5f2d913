"""Run the final layer's MLP only on the positions whose output is read.

A training loss reads the model's output at some positions only: a reward model at one position per
sequence (its last token), a language-model loss at the positions that have a label in its loss mask.
Every earlier layer is needed everywhere (attention reads all keys and values), but the final
layer's MLP is position-wise, so its result at an unread position is never used. `read_only(model,
rows)` leaves it out there: the MLP runs on the read rows only and adds zero elsewhere, so those
positions' outputs are meaningless but finite, and the loss, which masks them out, and every
gradient are unchanged. On the tiny reward model of bench/preference_vs_trl.py (4 layers) the final
MLP is ~19% of the matrix products of a step.

Left alone (the MLP runs everywhere): sequence parallelism (the MLP's input is split along the
sequence and gathered inside it), a recomputed MLP or layer (its forward runs again in the backward
pass), mixture-of-experts layers, and pipeline stages without the final layer.
"""
from __future__ import annotations

import contextlib

import torch


def final_mlp(gpt):
    """The final layer's dense MLP when `read_only` may skip positions in it, else None."""
    from megatron.core.transformer.mlp import MLP

    config = gpt.config
    if not gpt.post_process or config.sequence_parallel or config.recompute_granularity is not None:
        return None
    layer = gpt.decoder.layers[-1]
    if getattr(layer, "recompute_mlp", False) or not isinstance(layer.mlp, MLP):  # not MoE
        return None
    return layer.mlp


@contextlib.contextmanager
def read_only(model, rows: torch.Tensor):
    """Within the block, forwards of `model` (a GPTModel, possibly wrapped) run its final MLP only on
    `rows`: indices into the [s * b] positions of megatron's [s, b, hidden] layout (position t of
    batch row i is t * b + i)."""
    from aligner.models.checkpoint import unwrap

    mlp = final_mlp(unwrap(model))
    if mlp is None:
        yield
        return
    shape = {}

    def select(module, args, kwargs):
        hidden = args[0]
        shape["full"] = hidden.shape
        return (hidden.reshape(-1, hidden.shape[-1])[rows].unsqueeze(1), *args[1:]), kwargs

    def scatter(module, args, kwargs, output):
        out, bias = output
        s, b, width = shape["full"]
        full = out.new_zeros(s * b, width).index_copy(0, rows, out.squeeze(1))
        return full.view(s, b, width), bias

    handles = [mlp.register_forward_pre_hook(select, with_kwargs=True),
               mlp.register_forward_hook(scatter, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def masked_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """The read rows of a [b, s] loss mask, as `read_only` indexes them (position-major)."""
    return loss_mask.t().reshape(-1).nonzero().squeeze(1)
