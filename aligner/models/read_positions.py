"""Compute the final layer only at the positions whose output is read.

A training loss reads the model's output at some positions only: a reward model at one position per
sequence (its last token), a language-model loss at the positions that have a label in its loss mask.
Every earlier layer is needed everywhere (attention reads all keys and values), but in the final
layer only the queries, the attention output projection and the MLP of the read positions matter.
`read_only(model, rows)` leaves the rest out: the final MLP runs on the read rows only and, in a
flat packed row (`aligner.models.sdpa_attention.BlockDiagonalMask`), so do the attention queries
and the output projection; the other positions get a zero update there, so their outputs are
meaningless but finite, and the loss, which masks them out, and every gradient are unchanged. On the
tiny reward model of bench/preference_vs_trl.py (4 layers) the final layer without its keys and
values is ~23% of the matrix products of a step.

Left alone (computed everywhere): sequence parallelism (the layer's input is split along the
sequence), recomputed layers or MLPs (their forward runs again in the backward pass), mixture-of-
experts layers, pipeline stages without the final layer; and the attention of padded rows (b > 1)
or of other attention modules (context parallelism, Transformer Engine).

`output_at(model, rows)` goes further for the output layer (the vocabulary's logits, or a scalar
head): it runs on the read rows only and the model returns [1, n, width], the rows in `rows`' order,
so nothing is computed, kept or differentiated at the other positions. With a prompt of P tokens and
a response of R that is R / (P + R) of the logits' memory and matrix products (their softmax too).
Its callers read per-position tensors at the same rows (`at_rows`) and put the values back in the
[b, s] layout, zeros elsewhere (`from_rows`); with no read row (a context-parallel rank holding only
prompt positions) it computes nothing. Under sequence parallelism the layer's input arrives split
along the sequence: it is gathered first (what the layer would do itself), its backward taking this
rank's slice of the input gradient, which the layer, told the sequence is whole, has summed over TP.
`output_at` does nothing on pipeline stages without the output layer.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.mlp import MLP

from aligner.models.checkpoint import unwrap
from aligner.models.sdpa_attention import FusedCoreAttention


def final_layer(gpt):
    """The final transformer layer when `read_only` may skip positions in it, else None."""
    config = gpt.config
    if not gpt.post_process or config.sequence_parallel or config.recompute_granularity is not None:
        return None
    layer = gpt.decoder.layers[-1]
    if getattr(layer, "recompute_mlp", False) or not isinstance(layer.mlp, MLP):  # not MoE
        return None
    return layer


def _scatter(out: torch.Tensor, rows: torch.Tensor, shape) -> torch.Tensor:
    """[n, 1, width] results of the read rows -> [s, b, width], zeros elsewhere."""
    s, b, width = shape
    return out.new_zeros(s * b, width).index_copy(0, rows, out.reshape(-1, width)).view(s, b, width)


@contextlib.contextmanager
def read_only(model, rows: torch.Tensor):
    """Within the block, forwards of `model` (a GPTModel, possibly wrapped) compute its final layer
    only at `rows` where they can (see the module doc): indices into the [s * b] positions of
    megatron's [s, b, hidden] layout (position t of batch row i is t * b + i), ascending."""
    layer = final_layer(unwrap(model))
    if layer is None:
        yield
        return
    shapes = {}

    def record_attention_input(module, args, kwargs):
        shapes["attention"] = args[0].shape if args else kwargs["hidden_states"].shape

    def select_mlp_rows(module, args, kwargs):
        hidden = args[0]  # megatron passes the MLP's input positionally
        shapes["mlp"] = hidden.shape
        return (hidden.reshape(-1, hidden.shape[-1])[rows].unsqueeze(1), *args[1:]), kwargs

    def scatter(name):
        def hook(module, args, kwargs, output):
            out, bias = output
            if out.shape[0] * out.shape[1] == shapes[name][0] * shapes[name][1]:
                return output  # every row computed (the attention did not select)
            return _scatter(out, rows, (*shapes[name][:2], out.shape[-1])), bias
        return hook

    attention, core = layer.self_attention, getattr(layer.self_attention, "core_attention", None)
    handles = [layer.mlp.register_forward_pre_hook(select_mlp_rows, with_kwargs=True),
               layer.mlp.register_forward_hook(scatter("mlp"), with_kwargs=True),
               attention.register_forward_pre_hook(record_attention_input, with_kwargs=True),
               attention.register_forward_hook(scatter("attention"), with_kwargs=True)]
    if isinstance(core, FusedCoreAttention):
        core.read_rows = rows.tolist()
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if isinstance(core, FusedCoreAttention):
            core.read_rows = None


def masked_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """The read rows of a [b, s] loss mask, as `read_only` indexes them (position-major)."""
    return loss_mask.t().reshape(-1).nonzero().squeeze(1)


@contextlib.contextmanager
def output_at(model, rows: torch.Tensor):
    """Within the block, forwards of `model` (a GPTModel, possibly wrapped) compute the output layer at
    `rows` only (as `read_only` indexes them) and return [1, len(rows), width]. Yields whether they do
    (see the module doc for when they do not)."""
    gpt = unwrap(model)
    if not gpt.post_process:
        yield False
        return
    layer = gpt.output_layer  # megatron's ColumnParallelLinear or a `heads.ScalarHead`
    split = layer.sequence_parallel

    def select_rows(module, args, kwargs):
        hidden = args[0]  # megatron passes the output layer's input positionally: [s, b, hidden]
        if split:  # [s / TP, b, hidden] -> [s, b, hidden]; backward: this rank's slice
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            module.sequence_parallel = False
        return (hidden.reshape(-1, hidden.shape[-1])[rows].unsqueeze(1), *args[1:]), kwargs

    def restore(module, args, output):
        module.sequence_parallel = split
        out, bias = output
        # out [n, 1, width] gets its gradient as the transpose of the model's [1, n, width] output: strides
        # (width, n * width, 1), which torch.matmul does not fold into one matrix product (a frozen output
        # layer's input gradient ran as n vector-matrix products, ~5x slower on CPU); through squeeze and
        # unsqueeze it arrives with strides (width, width, 1)
        return out.squeeze(1).unsqueeze(1), bias

    handles = [layer.register_forward_pre_hook(select_rows, with_kwargs=True), layer.register_forward_hook(restore)]
    try:
        yield True
    finally:
        for handle in handles:
            handle.remove()
        layer.sequence_parallel = split


def at_rows(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A per-position tensor [b, s, *extra] at the read `rows` (position-major) -> [1, n, *extra]."""
    return values.transpose(0, 1).reshape(-1, *values.shape[2:])[rows].unsqueeze(0)


def from_rows(values: torch.Tensor, rows: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """`at_rows`' inverse for values [1, n, *extra] -> [b, s, *extra], zeros at the other positions;
    differentiable."""
    extra = values.shape[2:]
    flat = values.new_zeros(s * b, *extra).index_copy(0, rows, values[0])
    return flat.view(s, b, *extra).transpose(0, 1)
