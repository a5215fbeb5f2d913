"""One training step, in the pieces every trainer, the critic server and the RL loop share:
`forward_backward` (gradients of a list of micro-batches under megatron's schedule) and
`optimizer_step` (clip, update, advance the LR schedule); `forward_only` for validation passes.

Losses come from `aligner.models.forward_step`: each micro-batch's loss function returns `(loss_sum,
count, report)`, where `count` is the normaliser (loss tokens for SFT, pairs for DPO) and `report`
holds sums. The loss is divided by the global count (megatron's `calculate_per_token_loss`), and the
reports are summed over micro-batches and data- and context-parallel ranks, so that a metric
`sum(report[key]) / sum(count)` does not depend on how the batch was split.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from aligner.models.forward_step import run_micro_batches
from aligner.runtime import collectives


def forward_backward(model, optimizer, forward_step, micro_batches: list[dict], seq_length: int) -> dict:
    """Fresh gradients of this rank's micro-batches; returns the globally summed reports."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    return sum_reports(run_micro_batches(model, forward_step, micro_batches, seq_length, forward_only=False))


def optimizer_step(optimizer, scheduler) -> tuple[float, float]:
    """Clip and apply the gradients; returns (grad norm, the LR the update used)."""
    # Advance the schedule first: optimizer step k (1-based) uses the LR of step k, so warm-up never
    # spends a step at LR 0.
    scheduler.step(increment=1)
    _, grad_norm, _ = optimizer.step()
    return (grad_norm if grad_norm is not None else float("nan")), optimizer.param_groups[0]["lr"]


@torch.no_grad()
def forward_only(model, forward_step, micro_batches: list[dict], seq_length: int) -> dict:
    """The globally summed reports of a forward pass (validation)."""
    return sum_reports(run_micro_batches(model, forward_step, micro_batches, seq_length, forward_only=True))


def sum_reports(reports: list[dict]) -> dict:
    """Sum micro-batch reports over this rank, then over data- and context-parallel ranks, then
    share the result from the last pipeline stage with every stage."""
    sums = {}
    if ps.is_pipeline_last_stage():
        keys = sorted(reports[0]) if reports else []
        vector = torch.stack([sum(r[k] for r in reports) for k in keys]) if keys else torch.zeros(0)
        collectives.all_reduce(vector, group=ps.get_data_parallel_group(with_context_parallel=True))
        sums = dict(zip(keys, vector.tolist()))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        sums = collectives.broadcast_object(sums, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    return sums


def means(sums: dict, prefix: str = "") -> dict:
    """Every summed report divided by the summed count."""
    count = max(sums.get("count", 0.0), 1.0)
    return {prefix + k: v / count for k, v in sums.items() if k != "count"}
