"""Schema and cross-field rules of `aligner train kd` (conf/kd.yaml): knowledge distillation."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Optional

from aligner.config.schema import TrainRunConfig
from aligner.errors import ConfigError, UserError


class KDLoss(StrEnum):
    fwd_kl = "fwd_kl"  # KL(teacher || student) on the teacher's top-k ids
    bwd_kl = "bwd_kl"  # KL(student || teacher) on the teacher's top-k ids


@dataclass
class KDConfig:
    loss: KDLoss = KDLoss.fwd_kl
    loss_weight: float = 1.0  # weight of the KD divergence
    sft_loss_weight: float = 0.0  # weight of the student's NLL of the data (the SFT loss)
    teacher_logits_scale: float = 1.0  # the teacher's logits are multiplied by this (1 / temperature)
    student_logits_scale: float = 1.0  # the student's logits in the KD term are multiplied by this
    # offline: a directory written by `aligner teacher-logits` from data.train_path (same tokenizer)
    teacher_logits: Optional[str] = None
    # offline: the same for data.val_path; without it validation reports the student's NLL only
    val_teacher_logits: Optional[str] = None
    # online: a teacher checkpoint run in this process, at the student's parallel layout
    teacher: Optional[str] = None
    top_k: int = 100  # online: teacher ids per token (offline: the directory's)


@dataclass
class KDRunConfig(TrainRunConfig):
    run_dir: str = "runs/kd"
    kd: KDConfig = field(default_factory=KDConfig)


def validate_kd(cfg) -> None:
    """`aligner train kd` (after the common training checks)."""
    k = cfg.kd
    if not k.teacher and not k.teacher_logits:
        raise ConfigError("no teacher: set kd.teacher_logits=DIR (written by `aligner teacher-logits`) or "
                          "kd.teacher=CKPT (a teacher run in this process)")
    if k.teacher and k.teacher_logits:
        raise ConfigError("kd.teacher and kd.teacher_logits both set; use one (online teacher or precomputed logits)")
    if k.val_teacher_logits and not (k.teacher_logits and cfg.data.val_path):
        raise ConfigError("kd.val_teacher_logits needs kd.teacher_logits and data.val_path (the file it was "
                          "written from)")
    if k.loss_weight < 0 or k.sft_loss_weight < 0 or k.loss_weight == k.sft_loss_weight == 0:
        raise ConfigError(f"kd.loss_weight={k.loss_weight} and kd.sft_loss_weight={k.sft_loss_weight} must be >= 0 "
                          f"and not both 0")
    if k.teacher_logits_scale <= 0 or k.student_logits_scale <= 0:
        raise ConfigError("kd.teacher_logits_scale and kd.student_logits_scale must be > 0")
    if k.top_k < 1:
        raise ConfigError(f"kd.top_k must be >= 1, got {k.top_k}")
    for key in ("teacher_logits", "val_teacher_logits"):
        if k[key] and not Path(k[key]).is_dir():
            raise UserError(f"{k[key]} is not a directory", f"kd.{key}",
                            "pass the --out directory of `aligner teacher-logits`")
    if k.teacher:
        _validate_online_teacher(k.teacher, k.top_k, cfg.model)


def _validate_online_teacher(teacher: str, top_k: int, m) -> None:
    """The online teacher is a checkpoint with at least top_k tokens, and runs at the student's TP/PP:
    its heads and layers must split the same way. (Its vocabulary against the student's: in the ranks,
    which load the tokenizer.)"""
    meta_path = Path(teacher) / "aligner.json"
    if not meta_path.is_file():
        raise UserError(f"{teacher} is not an aligner checkpoint (no aligner.json)", "kd.teacher",
                        "pass a checkpoint directory (<run_dir>/checkpoints/step_N)")
    meta = json.loads(meta_path.read_text())
    if top_k > meta["vocab_size"]:
        raise ConfigError(f"kd.top_k={top_k} is larger than the teacher's vocabulary ({meta['vocab_size']} tokens); "
                          f"pass kd.top_k <= {meta['vocab_size']}")
    arch = meta["model"]
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    groups = arch.get("num_query_groups") or arch["num_attention_heads"]
    if arch["num_attention_heads"] % tp or groups % tp or arch["ffn_hidden_size"] % tp or arch["num_layers"] % pp:
        raise ConfigError(f"the teacher {teacher} ({arch['num_attention_heads']} heads, {groups} query groups, "
                          f"ffn {arch['ffn_hidden_size']}, {arch['num_layers']} layers) does not split at the "
                          f"student's TP={tp} x PP={pp}; pick a layout both models divide, or precompute its "
                          f"logits (`aligner teacher-logits --tp N --pp M`, kd.teacher_logits=DIR)")
