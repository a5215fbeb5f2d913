"""Knowledge distillation (`aligner train kd`, NeMo-Aligner's KD): SFT data, and at every loss token
the student learns the teacher's distribution over the teacher's top-k token ids
(`loss.topk_kd_divergence`, kd.loss=fwd_kl|bwd_kl) plus kd.sft_loss_weight x its NLL of the data.

Where the teacher's top-k comes from:
* offline (kd.teacher_logits=DIR): `aligner teacher-logits` wrote it per sample; sample i of the data
  file reads entry i (random access, so the reader's position is the sampler's, which every checkpoint
  keeps; the checkpoint also records which directory the run trains on, and a resume with another is
  refused). Validation uses kd.val_teacher_logits, else reports the student's NLL only.
* online (kd.teacher=CKPT): the teacher lives in every rank at the student's TP/PP and runs forward
  over each step's micro-batches (its own pipeline pass) before the student's; the top-k is taken on
  the fly by the same vocab-parallel code.
The loss is vocab-parallel: the student's logits stay split over TP ranks; its logits at the K ids are
gathered per shard and summed over the TP group, and the NLL's normaliser is an all-reduce
(`aligner.models.logprobs`). Metrics: `loss`, `kd/loss`, `sft/loss` (the student's NLL), per loss token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aligner.algorithms.distillation import loss as kd_loss
from aligner.algorithms.distillation import teacher_store as store
from aligner.algorithms.shared.sft import SFTFormat
from aligner.algorithms.distillation.teacher_ranks import loss_positions, topk_forward_step
from aligner.algorithms.shared.trainer import Trainer
from aligner.config import load_resolved
from aligner.data.jsonl import DataError
from aligner.data.sft import load_sft_dataset
from aligner.data.tokenizer import load_tokenizer, model_vocab_size
from aligner.errors import UserError
from aligner.models.checkpoint import PARALLEL_KEYS, load_language_model, read_metadata
from aligner.models.forward_step import make_forward_step, run_micro_batches, token_reduction
from aligner.models.gpt import build_gpt
from aligner.models.logprobs import vocab_parallel_gather, vocab_parallel_logprobs
from aligner.models.training import wrap_for_training
from aligner.runtime import distributed


# ---- data: SFT samples with the teacher's top-k at their loss positions ----------------------------------------
@dataclass(frozen=True)
class KDSample:
    ids: list[int]
    loss_mask: list[int]
    teacher_ids: torch.Tensor  # int64 [loss positions, K]
    teacher_logits: torch.Tensor  # float32 [loss positions, K]


class WithTeacherLogits:
    """The samples of a data file paired with a teacher-logits directory made from it."""

    def __init__(self, samples, teacher_logits: store.TeacherLogits):
        self.samples, self.teacher = samples, teacher_logits

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> KDSample:
        s = self.samples[index]
        ids, logits = self.teacher[index]
        if len(ids) != int(sum(s.loss_mask[1:])):  # the manifest checks make this a corrupted directory
            raise DataError(f"sample {index} has {int(sum(s.loss_mask[1:]))} loss tokens but {len(ids)} teacher "
                            f"entries", str(self.teacher.dir), "write the teacher logits again")
        return KDSample(s.ids, s.loss_mask, ids, logits)


class KDFormat(SFTFormat):
    """SFT's collation plus, for KDSamples, `teacher_ids` / `teacher_logits` [b, length, K] at the loss
    positions (0 elsewhere: those positions are masked)."""

    def collate(self, samples, length: int) -> dict:
        batch = super().collate(samples, length)
        if samples and isinstance(samples[0], KDSample):
            k = samples[0].teacher_ids.shape[-1]
            batch["teacher_ids"] = torch.zeros((len(samples), length, k), dtype=torch.int64)
            batch["teacher_logits"] = torch.zeros((len(samples), length, k), dtype=torch.float32)
            for row, s in enumerate(samples):
                at = loss_positions(s)
                batch["teacher_ids"][row, at], batch["teacher_logits"][row, at] = s.teacher_ids, s.teacher_logits
        return batch


# ---- the loss ------------------------------------------------------------------------------------------------
def kd_values(vocab_size: int):
    """Per-position values: (the student's log-prob of each label, its logits at the teacher's ids [b, s, K]
    and the teacher's logits there), the last two None without a teacher (offline validation)."""

    def values(logits, local):
        label_logprobs = vocab_parallel_logprobs(logits, local["labels"], vocab_size)
        if "teacher_ids" not in local:
            return label_logprobs, None, None
        positions = local["position_ids"][0]  # this context-parallel rank's positions (all of them without CP)
        teacher_ids = local["teacher_ids"][:, positions]
        return label_logprobs, vocab_parallel_gather(logits, teacher_ids), local["teacher_logits"][:, positions]

    return values


def kd_token_loss(k):
    """The loss of `kd` config `k` over a micro-batch's loss tokens: (loss sum, token count, report sums)."""

    def loss(values, local):
        label_logprobs, student, teacher = values
        mask = local["loss_mask"]
        if student is None:
            nll = -(label_logprobs * mask).sum()
            return nll, mask.sum(), {"sft/loss": nll}
        divergence = kd_loss.topk_kd_divergence(student, teacher, str(k.loss), k.student_logits_scale,
                                                k.teacher_logits_scale)
        total, kd, nll = kd_loss.kd_objective(divergence, label_logprobs, mask, k.loss_weight, k.sft_loss_weight)
        return total, mask.sum(), {"loss": total, "kd/loss": kd, "sft/loss": nll}

    return loss


def kd_forward_step(vocab_size: int, k):
    return make_forward_step(kd_values(vocab_size), token_reduction(kd_token_loss(k)))


# ---- the online teacher --------------------------------------------------------------------------------------
class ResidentTeacher:
    """A teacher checkpoint in this process at the student's parallel layout; `add_topk` runs it over a
    step's micro-batches and adds its top-k to each (on the last pipeline stage, where the loss runs)."""

    def __init__(self, path, model_cfg, top_k: int):
        self.model, self.vocab_size = load_language_model(path, **{key: model_cfg[key] for key in PARALLEL_KEYS})
        self.forward_step = topk_forward_step(top_k, self.vocab_size)

    @torch.no_grad()
    def add_topk(self, micro_batches: list[dict], length: int) -> None:
        outputs = run_micro_batches(self.model, self.forward_step, micro_batches, length, forward_only=True)
        for batch, out in zip(micro_batches, outputs):
            shape = (batch["tokens"].shape[0], length, out["ids"].shape[-1])
            batch["teacher_ids"] = out["ids"].new_zeros(shape)
            batch["teacher_logits"] = out["values"].new_zeros(shape)
            batch["teacher_ids"][:, out["positions"]] = out["ids"]
            batch["teacher_logits"][:, out["positions"]] = out["values"]


class KDTrainer(Trainer):
    def __init__(self, *args, teacher: ResidentTeacher | None = None, teacher_logits: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.teacher_logits = teacher, teacher_logits

    def step_micro_batches(self, samples: list) -> tuple[list[dict], int]:
        micro_batches, length = super().step_micro_batches(samples)
        if self.teacher is not None:
            self.teacher.add_topk(micro_batches, length)
        return micro_batches, length

    def loop_state(self) -> dict:
        return {"teacher_logits": self.teacher_logits}

    def load_loop_state(self, state: dict) -> None:
        saved = state.get("teacher_logits")
        if saved != self.teacher_logits:
            raise UserError(f"{self.run_dir} was trained with {_describe(saved)}, this run has "
                            f"{_describe(self.teacher_logits)}", "kd.teacher_logits",
                            "resume with the same teacher logits, or use a new run_dir")


def _describe(teacher_logits: dict | None) -> str:
    if teacher_logits is None:
        return "an online teacher (kd.teacher)"
    return (f"the top-{teacher_logits['top_k']} logits of {teacher_logits['teacher']['path']} for the data with "
            f"sha256 {teacher_logits['data_sha256'][:12]}")


# ---- the command ---------------------------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    """One rank started by the embedded launcher; argv = [resolved config.yaml]."""
    run(load_resolved(argv[0], "kd"))


def _open_teacher_logits(directory, key: str, data_path, tokenizer, cfg, vocab_size: int) -> store.TeacherLogits:
    """The teacher-logits reader of `data_path`, after checking it was made from that file and tokenizer."""
    d = cfg.data
    logits = store.TeacherLogits(directory, key)
    identity = store.data_identity(data_path, tokenizer, cfg.tokenizer.path, d.format, d.max_length, d.overlong)
    store.check_matches(logits.manifest, identity, key,
                        f"write them for this data: aligner teacher-logits --teacher CKPT --data {data_path} "
                        f"--tokenizer {cfg.tokenizer.path} --max-length {d.max_length} --out NEW_DIR")
    check_vocab(logits.vocab_size, vocab_size, key)
    return logits


def check_vocab(teacher_vocab: int, student_vocab: int, key: str) -> None:
    if teacher_vocab != student_vocab:
        raise UserError(f"the teacher's vocabulary has {teacher_vocab} tokens, the student's {student_vocab}", key,
                        "distil between models of one tokenizer (leave model.vocab_size unset, or set it to the "
                        "teacher's)")


def run(cfg) -> None:
    """One rank of `aligner train kd` with a validated config."""
    k, d, m = cfg.kd, cfg.data, cfg.model
    distributed.start_training_rank(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)
    train = load_sft_dataset(d.train_path, tokenizer, d.format, d.max_length, d.overlong)
    val = load_sft_dataset(d.val_path, tokenizer, d.format, d.max_length, d.overlong) if d.val_path else None
    identity = None
    if k.teacher_logits:
        logits = _open_teacher_logits(k.teacher_logits, "kd.teacher_logits", d.train_path, tokenizer, cfg, vocab_size)
        train, identity = WithTeacherLogits(train, logits), logits.manifest
        if k.val_teacher_logits:
            val = WithTeacherLogits(val, _open_teacher_logits(k.val_teacher_logits, "kd.val_teacher_logits",
                                                              d.val_path, tokenizer, cfg, vocab_size))
    else:
        check_vocab(read_metadata(k.teacher)["vocab_size"], vocab_size, "kd.teacher")
    model, optimizer, scheduler = wrap_for_training(build_gpt(m, vocab_size), m, cfg.optim)
    # built after the student, so that the student's initial weights do not depend on the mode
    teacher = ResidentTeacher(k.teacher, m, k.top_k) if k.teacher else None
    fingerprint = None if identity is None else {"data_sha256": identity["data"]["sha256"],
                                                  "teacher": identity["teacher"], "top_k": identity["top_k"]}
    trainer = KDTrainer(cfg, model, optimizer, scheduler, kd_forward_step(vocab_size, k), train, val,
                        KDFormat(tokenizer.pad_token_id), vocab_size, tokenizer, teacher=teacher,
                        teacher_logits=fingerprint)
    trainer.fit()
    distributed.shutdown()
