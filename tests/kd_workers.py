"""Rank entry points for tests/e2e/test_kd.py: the vocab-parallel KD loss, its gradient and the top-k at TP=2
against the same functions at TP=1 on the same tensors.

`loss_parity`: every rank draws the same full-vocabulary logits (VOCAB real ids padded to PADDED columns,
as megatron pads), computes the teacher's top-k and the KD forward step's loss and gradient first with no
model-parallel state (TP=1: one rank holds the whole vocabulary), then at TP=2 on its half of the
columns. Rank 0 writes the largest differences to <workdir>/parity.json.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

VOCAB, PADDED, K, BATCH, LENGTH = 37, 40, 5, 3, 6
CONFIGS = {"fwd_kl": SimpleNamespace(loss="fwd_kl", loss_weight=1.0, sft_loss_weight=0.5, student_logits_scale=1.0,
                                     teacher_logits_scale=1.0),
           "bwd_kl_scaled": SimpleNamespace(loss="bwd_kl", loss_weight=2.0, sft_loss_weight=0.0,
                                            student_logits_scale=0.7, teacher_logits_scale=1.5)}


def tensors():
    g = torch.Generator().manual_seed(3)
    student = 3 * torch.randn(BATCH, LENGTH, PADDED, generator=g)
    teacher = 3 * torch.randn(BATCH, LENGTH, PADDED, generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    mask = (torch.rand(BATCH, LENGTH, generator=g) > 0.3).float()
    return student, teacher, labels, mask


def loss_and_grad(student_shard: torch.Tensor, teacher_shard: torch.Tensor, labels, mask, cfg) -> dict:
    """The teacher's top-k, and the KD token loss (kd.py's values and loss) with its gradient wrt this
    rank's logits."""
    from aligner.algorithms.distillation.kd import kd_token_loss, kd_values
    from aligner.models.logprobs import vocab_parallel_topk

    values, ids = vocab_parallel_topk(teacher_shard, K, VOCAB)
    logits = student_shard.clone().requires_grad_(True)
    local = {"labels": labels, "loss_mask": mask, "teacher_ids": ids, "teacher_logits": values,
             "position_ids": torch.arange(LENGTH).expand(BATCH, -1)}
    loss, count, report = kd_token_loss(cfg)(kd_values(VOCAB)(logits, local), local)
    loss.backward()
    return {"ids": ids, "values": values, "loss": loss.detach(), "kd": report["kd/loss"].detach(),
            "sft": report["sft/loss"].detach(), "grad": logits.grad}


def loss_parity(argv: list[str]) -> None:
    from aligner.runtime.distributed import init_model_parallel, init_process_group

    workdir = Path(argv[0])
    init_process_group()
    torch.set_num_threads(1)
    student, teacher, labels, mask = tensors()
    reference = {name: loss_and_grad(student, teacher, labels, mask, cfg) for name, cfg in CONFIGS.items()}
    init_model_parallel(tp=2)
    from megatron.core import parallel_state as ps

    rank, half = ps.get_tensor_model_parallel_rank(), PADDED // 2
    columns = slice(rank * half, (rank + 1) * half)
    diffs = {}
    for name, cfg in CONFIGS.items():
        ours = loss_and_grad(student[..., columns], teacher[..., columns], labels, mask, cfg)
        parts = [torch.empty_like(ours["grad"]) for _ in range(2)]
        dist.all_gather(parts, ours["grad"], group=ps.get_tensor_model_parallel_group())
        ref = reference[name]
        diffs[name] = {"ids_equal": bool(torch.equal(ours["ids"], ref["ids"])),
                       "values": (ours["values"] - ref["values"]).abs().max().item(),
                       "loss": abs(ours["loss"].item() - ref["loss"].item()), "loss_value": ref["loss"].item(),
                       "kd": abs(ours["kd"].item() - ref["kd"].item()), "kd_value": ref["kd"].item(),
                       "sft": abs(ours["sft"].item() - ref["sft"].item()),
                       "grad": (torch.cat(parts, -1) - ref["grad"]).abs().max().item(),
                       "grad_norm": ref["grad"].norm().item(),
                       "padding_grad": ref["grad"][..., VOCAB:].abs().max().item(),
                       "ids_below_vocab": bool((ref["ids"] < VOCAB).all())}
    if dist.get_rank() == 0:
        (workdir / "parity.json").write_text(json.dumps(diffs))
