"""The one megatron forward step behind every training, validation and scoring pass.

megatron's pipeline schedules call `forward_step(data_iterator, model) -> (output, loss_func)` once
per micro-batch; `loss_func(output)` runs on the last pipeline stage and returns `(loss, count,
report)`. `make_forward_step(position_values, reduction)` builds it from two functions:
* `position_values(output, local) -> values`: what the loss reads at each position of this rank:
  `label_logprobs` (a language model's log-prob of each label, vocab-parallel) or `head_values` (a
  scalar head's outputs);
* `reduction(values, local, batch) -> (loss, count, report)`: the loss over those values. `local`
  holds this context-parallel rank's slice of the micro-batch, `batch` the whole of it.
`report` holds sums (the trainer divides them by the global `count`, see algorithms/shared/training_step.py);
a forward-only pass returns what it wants to keep in `report` (`collect`).

Two kinds of micro-batch reach the model:
* sequence batches (`aligner.data.packing.build_micro_batches`: padded or packed rows, with
  `sequence_index`): the model is a `aligner.models.policy` model reading explicit positions;
  packed rows carry their block-causal attention mask; the final layer runs only at the positions
  the loss reads (`read_positions.read_only`), and so does the output layer (`read_positions.output_at`:
  the vocabulary's logits exist only at those positions, a response's and not its prompt's):
  `position_values` sees the output [1, n, ...] and the per-position inputs at those n positions, and
  its values are put back in the [rows, s] layout, zeros elsewhere, before the reduction.
  `sequence_reduction` turns position values into per-sequence sums.
* row batches (one sequence per row from position 0: SFT's padded batches, padded reward-model
  pairs, the servers' scoring and the critic's training): the keys in `ROW_POSITION_KEYS` are
  per-position tensors [b, s] and are sliced for context parallelism; every other key is per row.

Context parallelism: each rank holds two load-balanced chunks of every row. A token-level loss sums
over this rank's positions (the count too); a sequence-level loss needs whole-sequence sums, so the
partial sums are summed over the CP group first (forward all-reduce, backward identity: each rank's
gradient reaches only its positions, and megatron's gradient all-reduce over DP x CP adds them once).
Every CP rank then computes the same loss, and the count and the reports come from CP rank 0 only
(`counted_once`; RL's per-response-token values are summed over the CP group the same way, online/loss.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from aligner.data.packing import tree_attention_mask
from aligner.models.checkpoint import unwrap
from aligner.models.cp_attention import positions_on_rank
from aligner.models.heads import last_token_scores
from aligner.models.logprobs import vocab_parallel_logprobs
from aligner.models.read_positions import at_rows, from_rows, masked_rows, output_at, read_only
from aligner.models.sdpa_attention import BlockDiagonalMask, all_fused
from aligner.runtime import cpu_shims
from aligner.runtime.distributed import sum_over_group

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "sequence_index", "shared_index", "position_ids")  # sliced for CP
ROW_POSITION_KEYS = ("tokens", "labels", "loss_mask", "returns", "prev_values", "mask")  # sliced for CP

# (model output on this rank's positions, the micro-batch's local tensors) -> values per position
PositionValues = Callable[[torch.Tensor, dict], torch.Tensor]
# (position values, local tensors, the whole micro-batch) -> (loss, count, report sums)
Reduction = Callable[[torch.Tensor, dict, dict], tuple[torch.Tensor, torch.Tensor, dict]]


def label_logprobs(vocab_size: int) -> PositionValues:
    """A language model's per-position values: the log-prob of each position's label."""
    return lambda logits, local: vocab_parallel_logprobs(logits, local["labels"], vocab_size)


def head_values(output: torch.Tensor, local: dict) -> torch.Tensor:
    """A scalar-head model's per-position values: its outputs [rows, s, k] in float32."""
    return output.float()


def make_forward_step(position_values: PositionValues, reduction: Reduction, output_at_read_positions: bool = True):
    """The megatron forward step of any pass: `reduction(position_values(output, local), local, batch)`.
    `output_at_read_positions`: on sequence batches, compute the output layer only where the loss reads
    (the module doc); False computes it everywhere (the same values: tests and benchmarks compare the two)."""
    device = _device()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output, local = run_model(batch, model, device, output_at_read_positions)

        def loss_func(output):
            loss, count, report = reduction(values_at_positions(position_values, output, local), local, batch)
            report = {k: v.detach().float() for k, v in report.items()}
            report["count"] = count.detach().float()
            return loss, count.int(), report

        return output, loss_func

    return forward_step


def run_micro_batches(model, forward_step, micro_batches: list[dict], seq_length: int,
                      forward_only: bool) -> list[dict]:
    """Forward (+ backward) over this rank's micro-batches with megatron's schedule for the current
    pipeline layout (1F1B when PP > 1). Returns each micro-batch's report on the last pipeline
    stage, [] elsewhere."""
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=seq_length,
        micro_batch_size=micro_batches[0]["tokens"].shape[0], forward_only=forward_only)


def values_at_positions(position_values: PositionValues, output: torch.Tensor, local: dict) -> torch.Tensor:
    """`position_values(output, local)` [rows, s_local, ...]; for an output computed at the read rows only
    (`local["output_rows"]`), from the per-position inputs at those rows, put back in place (zeros elsewhere)."""
    rows = local.get("output_rows")
    if rows is None:
        return position_values(output, local)
    b, s = local["tokens"].shape
    read = {k: at_rows(v, rows) if k in SEQUENCE_KEYS else v for k, v in local.items()}
    return from_rows(position_values(output, read), rows, b, s)


# ---- reductions ------------------------------------------------------------------------------------------
def token_reduction(token_loss: Callable[[torch.Tensor, dict], tuple]) -> Reduction:
    """A loss over this rank's positions: `token_loss(values, local) -> (loss, count, report)`."""
    return lambda values, local, batch: token_loss(values, local)


def sequence_reduction(sequence_loss: Callable[[torch.Tensor, torch.Tensor, dict], tuple]) -> Reduction:
    """A loss on per-sequence sums of a sequence batch: `sequence_loss(sums, counts, batch)` gets the
    sums of the position values over each sequence's masked positions (summed over the CP group)
    and each sequence's masked position count, in the order the sequences were given."""

    def reduce(values, local, batch):
        sums, counts = sequence_sums(values, local, batch)
        return counted_once(*sequence_loss(sums, counts, batch))

    return reduce


def last_token_reduction(score_loss: Callable[[torch.Tensor, dict], tuple]) -> Reduction:
    """A loss on the values at each row's last token (`batch["lengths"]` [b]) of a row batch:
    `score_loss(scores [b, k], batch)`; the scores are summed over the CP group."""

    def reduce(values, local, batch):
        return counted_once(*score_loss(scores_at_row_ends(values, batch["lengths"], local["position_ids"][0]), batch))

    return reduce


def collect(output: Callable[[torch.Tensor, dict, dict], torch.Tensor]) -> Reduction:
    """A forward-only pass that keeps `output(values, local, batch)` per micro-batch as `report["out"]`."""

    def reduce(values, local, batch):
        zero = values.new_zeros(())
        return zero, zero, {"out": output(values, local, batch)}

    return reduce


# ---- per-sequence and per-row values ---------------------------------------------------------------------
def sequence_sums(values: torch.Tensor, local: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums over each sequence's masked positions of `values` [rows, s_local(, k)], summed over the
    CP group; masked position counts [n]). A packed pair's trunk counts for both of its sequences."""
    n = batch["num_sequences"]

    def per_sequence(values, source):
        shared = source["loss_mask"] * (source["shared_index"] >= 0)
        return [a + b for a, b in zip(index_sums(values, source["loss_mask"], source["sequence_index"], n),
                                      index_sums(values, shared, source["shared_index"], n))]

    sums, _ = per_sequence(values, local)
    if ps.get_context_parallel_world_size() > 1:
        sums = sum_over_group(sums, ps.get_context_parallel_group())
    _, counts = per_sequence(batch["loss_mask"], batch)
    return sums, counts


def index_sums(values: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
               num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of masked position values and per-sequence masked-position counts.

    mask, index: [rows, seq]; values: [rows, seq, *extra] (e.g. a reward head's k outputs); `index`
    says which sequence a position belongs to (any value where `mask` is 0). Several sequences may
    share a row (packing). Returns (sums [num_sequences, *extra] float32, counts [num_sequences]
    float32); differentiable in `values`."""
    # every position, the masked-out ones as 0 into sequence 0 (x + 0.0 == x): boolean indexing would make
    # the host wait for the device to count the kept positions, twice per call
    keep = mask > 0
    rows = torch.where(keep, index, 0).flatten()
    kept = torch.where(keep.view(*keep.shape, *(1,) * (values.dim() - mask.dim())), values.float(), 0.0)
    shape = (num_sequences, *values.shape[mask.dim():])
    sums = values.new_zeros(shape, dtype=torch.float32).index_add(0, rows, kept.flatten(0, mask.dim() - 1))
    counts = mask.new_zeros(num_sequences, dtype=torch.float32).index_add(
        0, rows, torch.where(keep, mask.float(), 0.0).flatten())
    return sums, counts


def scores_at_row_ends(values: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`heads.last_token_scores` of a row batch under context parallelism: values [b, s_local, k] at
    global `positions` [s_local] (this CP rank's chunks) -> [b, k], summed over the CP group."""
    if ps.get_context_parallel_world_size() == 1:
        return last_token_scores(values, lengths)
    at_last = (positions.view(1, -1) == (lengths.view(-1, 1) - 1)).to(values.dtype)
    return sum_over_group((values * at_last.unsqueeze(-1)).sum(1), ps.get_context_parallel_group())


# ---- model inputs ----------------------------------------------------------------------------------------
def run_model(batch: dict, model, device, output_at_read_positions: bool = False) -> tuple[torch.Tensor, dict]:
    """Run the model on this CP rank's positions of a micro-batch; returns (output, local tensors).
    `output_at_read_positions`: a sequence batch's output only at the rows the loss reads, which are then
    `local["output_rows"]` (the module doc)."""
    if device is not None:
        batch.update({k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)})
    if "sequence_index" in batch:
        return _run_on_sequences(batch, model, output_at_read_positions)
    return _run_on_rows(batch, model)


def _run_on_rows(batch: dict, model) -> tuple[torch.Tensor, dict]:
    tokens = batch["tokens"]
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        positions = positions_on_rank(tokens.shape[1], cp, ps.get_context_parallel_rank()).to(tokens.device)
        local = {k: v[:, positions] if k in ROW_POSITION_KEYS else v for k, v in batch.items()}
    else:
        positions, local = torch.arange(tokens.shape[1], device=tokens.device), dict(batch)
    local["position_ids"] = positions.unsqueeze(0).expand(tokens.shape[0], -1)
    with _no_literals(model, cp):
        return model(local["tokens"], local["position_ids"], None), local


def _no_literals(model, cp: int):
    """With torch's fused attention in every layer and no CP the forward passes no CUDA literals: bypass
    the CPU shims' per-op rewriting. megatron's own attention builds its causal mask on "cuda", and with
    CP its rotary code pins memory (P8)."""
    return cpu_shims.without_literal_rewrites() if cp == 1 and all_fused(unwrap(model)) else contextlib.nullcontext()


def _run_on_sequences(batch: dict, model, output_at_read_positions: bool) -> tuple[torch.Tensor, dict]:
    cp = ps.get_context_parallel_world_size()
    with _no_literals(model, cp):
        positions = None
        if cp > 1:
            positions = positions_on_rank(batch["tokens"].shape[1], cp, ps.get_context_parallel_rank())
            positions = positions.to(batch["tokens"].device)
        local = {k: batch[k] if positions is None else batch[k][:, positions] for k in SEQUENCE_KEYS}
        if batch["packed"] and "attention_mask" not in batch:  # kept for the batch's other passes (reference, policy)
            if "blocks" in batch:  # a flat packed row (never under CP: the trainers build rows there)
                batch["attention_mask"] = BlockDiagonalMask.from_tree(batch["segments"], batch["parents"],
                                                                      batch["blocks"])
            else:
                batch["attention_mask"] = tree_attention_mask(batch["segments"], batch["parents"], positions)
        # whole-row positions, one set per rotary section (`models.policy.with_token_positions`); megatron slices
        # them for CP
        position_ids = batch["position_ids"].unsqueeze(0).expand(3, -1, -1)
        # the losses read the output only where the loss mask is set (`sequence_sums`)
        rows = masked_rows(local["loss_mask"])
        outputs_read = output_at(model, rows) if output_at_read_positions else contextlib.nullcontext(False)
        with read_only(model, rows), outputs_read as compact:
            output = model(local["tokens"], position_ids, batch.get("attention_mask"))
        if compact:
            local["output_rows"] = rows
        return output, local


def counted_once(loss, count, report) -> tuple:
    """A loss every CP rank computes alike (from sums over the CP group): its count and reports come from
    CP rank 0 only, so that the sums over DP x CP ranks count it once."""
    keep = 1.0 if ps.get_context_parallel_rank() == 0 else 0.0
    return loss, count * keep, {k: v * keep for k, v in report.items()}


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
