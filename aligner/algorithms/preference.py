"""Offline preference optimisation on the shared trainer loop: what DPO, ORPO, SimPO and KTO share.

A step, for every algorithm (`dpo.py`, `orpo.py`, `simpo.py`, `kto.py` only bind the loss):
  global batch -> this DP rank's samples -> micro-batches of token sequences (padded, or packed with
  block-causal attention, `aligner.data.packing`) -> forward-only pre-passes: the frozen reference's
  log-probs (DPO, KTO) and the policy's log-probs on KTO's mismatched pairs -> the megatron schedule
  with the algorithm's loss on per-sequence log-probs -> optimizer step (trainer.py).

Per-sequence log-probs are sums of `vocab_parallel_logprobs` over the response tokens. Under context
parallelism each rank holds two chunks of every row, so its partial sums are summed over the CP group
before the (nonlinear) loss: forward all-reduce, backward identity, so each rank's gradient reaches
only the positions it holds, and megatron's gradient all-reduce over DP x CP adds them up once. Every
CP rank computes the same loss; the count and the reported sums come from CP rank 0 only. Under
pipeline parallelism the loss (and the reference log-probs it needs) live on the last stage.

The reference model is the policy's initial weights (`model.pretrained`, or the seeded
initialisation), frozen; `reference.mode` says where it lives:
* `model`: a second GPTModel with the policy's layout (memory: one more copy of the weights).
* `cpu_swap`: its weights stay in CPU memory and are copied into the policy for the reference pass,
  then the policy's weights are copied back (NeMo-Aligner's approach; memory: none on the device).
* `precompute`: its log-probs are computed once for every sample before training and cached in
  `<run_dir>/reference/<split>.pt` (keyed by a fingerprint of the tokens and of the reference), so
  a resumed run reads them back; no reference weights are kept during training.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from aligner.algorithms import functional as F
from aligner.algorithms.trainer import Trainer, run_schedule
from aligner.data.packing import build_micro_batches, tree_attention_mask, with_response_mask
from aligner.models.read_positions import masked_rows, read_only
from aligner.runtime import cpu_shims
from aligner.runtime.distributed import sum_over_group

log = logging.getLogger(__name__)

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "sequence_index", "shared_index")  # sliced for CP

# (per-sequence log-prob sums [n], response token counts [n], micro-batch) -> (loss sum, count, report sums)
SequenceLoss = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor, dict]]
# (model output on this rank's positions, the micro-batch's local tensors) -> values per position
PositionValues = Callable[[torch.Tensor, dict], torch.Tensor]


# ---- forward steps -----------------------------------------------------------------------------------
def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _forward(batch: dict, model, device):
    """Run the model on this CP rank's positions of a micro-batch; returns (output, local tensors)."""
    from megatron.core import parallel_state as ps

    from aligner.models.checkpoint import unwrap
    from aligner.models.cp_attention import positions_on_rank
    from aligner.models.sdpa_attention import BlockDiagonalMask, all_fused

    if device is not None:
        batch.update({k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)})
    cp = ps.get_context_parallel_world_size()
    # With torch's fused attention in every layer and no CP the forward passes no CUDA literals; megatron's
    # own attention builds its causal mask on "cuda", and with CP its rotary code pins memory (P8).
    with cpu_shims.without_literal_rewrites() if cp == 1 and all_fused(unwrap(model)) else contextlib.nullcontext():
        positions = None
        if cp > 1:
            positions = positions_on_rank(batch["tokens"].shape[1], cp, ps.get_context_parallel_rank())
            positions = positions.to(batch["tokens"].device)
        local = {k: batch[k] if positions is None else batch[k][:, positions] for k in SEQUENCE_KEYS}
        if batch["packed"] and "attention_mask" not in batch:  # kept for the batch's other passes (reference, policy)
            if "blocks" in batch:  # a flat packed row (never under CP: `PreferenceTrainer` builds rows there)
                batch["attention_mask"] = BlockDiagonalMask.from_tree(batch["segments"], batch["parents"],
                                                                      batch["blocks"])
            else:
                batch["attention_mask"] = tree_attention_mask(batch["segments"], batch["parents"], positions)
        # whole-row positions, one set per rotary section (see `with_token_positions`); megatron slices them for CP
        position_ids = batch["position_ids"].unsqueeze(0).expand(3, -1, -1)
        # the losses read the output only where the loss mask is set (`_sequence_sums`)
        with read_only(model, masked_rows(local["loss_mask"])):
            return model(local["tokens"], position_ids, batch.get("attention_mask")), local


def label_logprobs(vocab_size: int) -> PositionValues:
    """A language model's per-position values: the log-prob of each position's label."""
    from aligner.models.logprobs import vocab_parallel_logprobs

    return lambda logits, local: vocab_parallel_logprobs(logits, local["labels"], vocab_size)


def head_outputs(values: torch.Tensor, local: dict) -> torch.Tensor:
    """A scalar-head model's per-position values: its outputs [rows, s, k] (a reward model's
    sequences mask only their last position, so a sequence's sum is its reward there)."""
    return values.float()


def _sequence_sums(values, local: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums over each sequence's masked positions of per-position `values` [rows, s_local(, k)],
    summed over the CP group; masked position counts [n])."""
    from megatron.core import parallel_state as ps

    n = batch["num_sequences"]

    def per_sequence(values, source):  # a packed pair's trunk counts for both of its sequences
        shared = source["loss_mask"] * (source["shared_index"] >= 0)
        return [a + b for a, b in zip(F.sequence_sums(values, source["loss_mask"], source["sequence_index"], n),
                                      F.sequence_sums(values, shared, source["shared_index"], n))]

    sums, _ = per_sequence(values, local)
    if ps.get_context_parallel_world_size() > 1:
        sums = sum_over_group(sums, ps.get_context_parallel_group())
    _, counts = per_sequence(batch["loss_mask"], batch)
    return sums, counts


def make_sequence_forward_step(sequence_loss: SequenceLoss, vocab_size: int,
                               position_values: PositionValues | None = None):
    """The megatron forward step of a training (or validation) pass: `sequence_loss` gets the
    per-sequence sums of `position_values` (default: `label_logprobs`, the log-probs of a language
    model) of the micro-batch's sequences, in the order they were given."""
    from megatron.core import parallel_state as ps

    device = _device()
    position_values = position_values or label_logprobs(vocab_size)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output, local = _forward(batch, model, device)

        def loss_func(output):
            sums, counts = _sequence_sums(position_values(output, local), local, batch)
            loss, count, report = sequence_loss(sums, counts, batch)
            keep = 1.0 if ps.get_context_parallel_rank() == 0 else 0.0
            report = {k: v.detach().float() * keep for k, v in report.items()}
            report["count"] = count.detach().float() * keep
            return loss, (count * keep).int(), report

        return output, loss_func

    return forward_step


def _logprob_forward_step(vocab_size: int):
    device = _device()
    position_values = label_logprobs(vocab_size)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output, local = _forward(batch, model, device)

        def collect(logits):
            sums, _ = _sequence_sums(position_values(logits, local), local, batch)
            return sums.new_zeros(()), torch.zeros((), dtype=torch.int), {"sums": sums.detach()}

        return output, collect

    return forward_step


@torch.no_grad()
def logprob_sums(model, micro_batches: list[dict], length: int, vocab_size: int) -> list[torch.Tensor]:
    """Per-sequence log-prob sums of every micro-batch (forward only, no grad, eval mode) on the last
    pipeline stage, summed over the CP group; an empty list on other stages."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    was_training = model.training
    model.eval()
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=_logprob_forward_step(vocab_size), data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches), seq_length=length,
            micro_batch_size=micro_batches[0]["tokens"].shape[0], forward_only=True)
    finally:
        model.train(was_training)
    return [o["sums"] for o in outputs]


# ---- models ----------------------------------------------------------------------------------------------
def with_token_positions(gpt):
    """Make a rotary GPTModel read each token's position from `position_ids` instead of its row
    position, so that packed sequences (and the branches of a packed pair) get their own positions.

    megatron's GPTModel applies rotary embeddings by row position for `rope`; its `mrope` path reads
    per-token positions from `position_ids` [3, batch, seq] and uses section i of the frequencies from
    position row i. With every frequency in section 0 that is plain RoPE at the given positions
    (bitwise equal to `rope` for row positions; tests/test_packing.py). The frequencies are taken over
    from the model, so Llama-3.1 scaling is kept. Rotary embeddings hold no weights: checkpoints do not
    change. Returns `gpt`."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

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
    """`build_gpt` with explicit token positions (`with_token_positions`) and, on the local layer
    spec, torch's fused attention kernel (`aligner.models.sdpa_attention`)."""
    from aligner.models.gpt import build_gpt
    from aligner.models.sdpa_attention import use_fused_attention

    gpt = with_token_positions(build_gpt(model_cfg, vocab_size))
    use_fused_attention(gpt)
    return gpt


# ---- the reference model -----------------------------------------------------------------------------
def _params(model) -> dict[str, torch.nn.Parameter]:
    from aligner.models.checkpoint import unwrap

    return dict(unwrap(model).named_parameters())


class Reference:
    """The frozen initial policy, as a second model (`model`) or as CPU weights swapped into the
    policy (`cpu_swap`). Build it before the trainer resumes, while the policy holds its initial
    weights; with `pretrained` those are loaded from the checkpoint instead."""

    def __init__(self, mode: str, policy, model_cfg, vocab_size: int, pretrained: str | None):
        from aligner.models import checkpoint

        self.mode, self.policy, self.vocab_size = mode, policy, vocab_size
        model = build_policy(model_cfg, vocab_size)
        if pretrained:
            checkpoint.load_weights(pretrained, model)
        else:
            mine = _params(model)
            with torch.no_grad():
                for name, p in _params(policy).items():
                    mine[name].copy_(p)
        for p in model.parameters():
            p.requires_grad_(False)
        if model_cfg.params_dtype == "bfloat16":
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        model.eval()
        if mode == "cpu_swap":
            self.weights = {n: p.detach().to("cpu", copy=True) for n, p in _params(model).items()}
            pinned = torch.cuda.is_available()
            self.backup = {n: torch.empty_like(w, pin_memory=pinned) for n, w in self.weights.items()}
            self.model = None
        else:
            self.model = model

    def load_from(self, params: dict[str, torch.Tensor]) -> None:
        """Make `params` (a model's named parameters) the reference weights (SPIN renews it)."""
        target = self.weights if self.mode == "cpu_swap" else _params(self.model)
        with torch.no_grad():
            for name, p in params.items():
                target[name].copy_(p)

    @contextlib.contextmanager
    def _swapped_in(self):
        params = _params(self.policy)
        with torch.no_grad():
            for name, p in params.items():
                self.backup[name].copy_(p)
                p.copy_(self.weights[name])
        try:
            yield self.policy
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(self.backup[name])

    def logprob_sums(self, micro_batches: list[dict], length: int) -> list[torch.Tensor]:
        context = self._swapped_in() if self.mode == "cpu_swap" else contextlib.nullcontext(self.model)
        with context as model:
            return logprob_sums(model, micro_batches, length, self.vocab_size)


# ---- precomputed reference log-probs -------------------------------------------------------------------
def _fingerprint(dataset, sequences_of, reference_id: str) -> str:
    digest = hashlib.sha256(reference_id.encode())
    for sample in dataset:
        for ids, mask in sequences_of(sample):
            digest.update(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes())
            digest.update(torch.as_tensor(mask, dtype=torch.int8).numpy().tobytes())
    return digest.hexdigest()


def reference_table(reference: Reference, dataset, sequences_of, micro_batch_size: int, pad_id: int,
                    packing: dict) -> torch.Tensor:
    """[len(dataset), k] reference log-prob sums of each sample's k sequences, on every rank.
    Samples are split over data-parallel ranks in contiguous chunks."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n, k = len(dataset), len(sequences_of(dataset[0]))
    per_rank = -(-n // dp)
    mine = list(range(dp_rank * per_rank, min(n, (dp_rank + 1) * per_rank)))
    table = torch.zeros(n, k, dtype=torch.float32, device=_device())
    # Enough micro-batches per schedule call to amortise the pipeline, few enough to bound padding.
    for start in range(0, len(mine), 8 * micro_batch_size):
        chunk = mine[start:start + 8 * micro_batch_size]
        groups = [chunk[i:i + micro_batch_size] for i in range(0, len(chunk), micro_batch_size)]
        seqs = [_interleave([sequences_of(dataset[i]) for i in g]) for g in groups]
        micro, length = build_micro_batches(seqs, pad_id, pairs=k == 2, **packing)
        for g, sums in zip(groups, reference.logprob_sums(micro, length)):
            table[g] = sums.view(k, len(g)).t().to(table.dtype)
    contributes = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_context_parallel_rank() == 0)
    if not contributes:
        table.zero_()
    dist.all_reduce(table)
    return table.cpu()


def _interleave(per_sample: list[list]) -> list:
    """[[a0, b0], [a1, b1]] -> [a0, a1, b0, b1]: sequence j of every sample, then sequence j + 1."""
    return [seqs[j] for j in range(len(per_sample[0])) for seqs in per_sample]


def cached_reference(run_dir: Path, split: str, dataset, reference: Reference, sequences_of, reference_id: str,
                     micro_batch_size: int, pad_id: int, packing: dict):
    """`dataset` with each sample's reference log-probs, read from `<run_dir>/reference/<split>.pt`
    when its fingerprint matches, else computed (collective) and written there."""
    path = Path(run_dir) / "reference" / f"{split}.pt"
    fingerprint = _fingerprint(dataset, sequences_of, reference_id)
    if path.exists():
        cached = torch.load(path, weights_only=True)
        if cached["fingerprint"] == fingerprint:
            log.info("reference log-probs for %s read from %s", split, path)
            return dataset.with_reference(cached["values"].tolist())
        log.warning("%s was computed for other data or another reference; recomputing", path)
    values = reference_table(reference, dataset, sequences_of, micro_batch_size, pad_id, packing)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"fingerprint": fingerprint, "values": values}, tmp)
        tmp.replace(path)
    dist.barrier()
    return dataset.with_reference(values.tolist())


# ---- algorithms ----------------------------------------------------------------------------------------
class PreferenceAlgorithm:
    """What differs between DPO, ORPO, SimPO and KTO: the sequences a sample trains on, the
    pre-passes that annotate a step's micro-batches, and the loss on per-sequence log-probs."""

    uses_reference = False

    def sequences(self, sample) -> list:
        """The sample's training sequences as (ids, mask); a micro-batch lists sequence j of all its
        samples before sequence j + 1 (DPO: all chosen, then all rejected)."""
        raise NotImplementedError

    def reference_sequences(self, sample) -> list:
        """The sequences whose reference log-probs the loss needs (precomputed per sample)."""
        return self.sequences(sample)

    def annotate(self, trainer: "PreferenceTrainer", samples: Sequence, groups: list, micro: list[dict],
                 length: int) -> None:
        """Add what the loss needs to each micro-batch (reference log-probs, rewards, ...)."""

    def loss(self, sums: torch.Tensor, counts: torch.Tensor, batch: dict):
        raise NotImplementedError

    def tokens(self, sample) -> int:
        return sum(len(ids) for ids, _ in self.sequences(sample))


class PreferenceFormat:
    """`BatchFormat` of the preference algorithms (the trainer reads `length` and `tokens`; the
    micro-batches themselves are built by `PreferenceTrainer`)."""

    def __init__(self, algorithm: PreferenceAlgorithm, pad_id: int):
        self.algorithm, self.pad_id = algorithm, pad_id

    def length(self, sample) -> int:
        return max(len(ids) - 1 for ids, _ in self.algorithm.sequences(sample))

    def tokens(self, sample) -> int:
        return self.algorithm.tokens(sample)

    def collate(self, samples, length: int) -> dict:
        seqs = _interleave([self.algorithm.sequences(s) for s in samples])
        return build_micro_batches([seqs], self.pad_id)[0][0]


class PreferenceTrainer(Trainer):
    """The shared loop with preference micro-batches (padded or packed) and the algorithm's
    pre-passes before each schedule; builds the reference at resume (see the module doc)."""

    def __init__(self, *args, algorithm: PreferenceAlgorithm, reference_mode: str | None, packing: dict,
                 **kwargs):
        from megatron.core import parallel_state as ps

        from aligner.models.checkpoint import unwrap
        from aligner.models.sdpa_attention import all_fused

        super().__init__(*args, **kwargs)
        # Packed rows are flat (no padding between bins) where the attention takes block masks; the
        # portable context-parallel attention takes a dense mask over its chunks of a row.
        flat = packing["packed"] and ps.get_context_parallel_world_size() == 1 and all_fused(unwrap(self.model))
        self.algorithm, self.reference_mode, self.packing = algorithm, reference_mode, {**packing, "flat": flat}
        self.reference: Reference | None = None

    def resume(self) -> None:
        if self.algorithm.uses_reference:
            m = self.cfg.model
            self.reference = Reference("model" if self.reference_mode == "precompute" else self.reference_mode,
                                       self.model, m, self.vocab_size, m.pretrained)
            if self.reference_mode == "precompute":
                reference_id = f"{m.pretrained or f'init seed={self.cfg.trainer.seed}'} {dict(m)}"
                common = (self.reference, self.algorithm.reference_sequences, reference_id,
                          self.cfg.trainer.micro_batch_size, self.batch_format.pad_id, self.packing)
                self.train_data = cached_reference(self.run_dir, "train", self.train_data, *common)
                if self.val_data is not None:
                    self.val_data = cached_reference(self.run_dir, "val", self.val_data, *common)
                self.reference = None  # the table replaces it
        super().resume()

    def micro_batches(self, groups: list[list], sequences_of) -> tuple[list[dict], int]:
        """Padded or packed micro-batches of each group's sequences; two sequences per sample (a pair,
        or KTO's completion and its mismatched twin) share their common prefix when packed."""
        per_sample = [[sequences_of(s) for s in g] for g in groups]
        pairs = len(per_sample[0][0]) == 2
        return build_micro_batches([_interleave(seqs) for seqs in per_sample], self.batch_format.pad_id,
                                   multiple=self.length_multiple, pairs=pairs, **self.packing)

    def _run_schedule(self, samples, forward_only: bool) -> dict:
        from aligner.data.loader import split_for_rank

        mbs = self.cfg.trainer.micro_batch_size
        mine = split_for_rank(samples, self.dp_rank, self.dp_size)
        groups = [mine[i:i + mbs] for i in range(0, len(mine), mbs)]
        micro, length = self.micro_batches(groups, self.algorithm.sequences)
        self.algorithm.annotate(self, samples, groups, micro, length)
        return run_schedule(self.model, self.forward_step, micro, length, forward_only)

    def reference_logprobs(self, groups: list[list], sequences_of, micro: list[dict] | None = None,
                           length: int = 0) -> list[torch.Tensor]:
        """Reference log-prob sums of each micro-batch's `sequences_of` its samples (in micro-batch
        order) on the last pipeline stage, an empty list elsewhere. Pass `micro`/`length` when those
        sequences are the training ones, to reuse the built micro-batches."""
        if self.reference is None:  # precomputed: carried by the samples
            k = len(sequences_of(groups[0][0]))
            return [torch.tensor([s.reference[j] for j in range(k) for s in g]) for g in groups]
        if micro is None:
            micro, length = self.micro_batches(groups, sequences_of)
        return self.reference.logprob_sums(micro, length)


def attach(micro: list[dict], key: str, values: list[torch.Tensor]) -> None:
    for batch, value in zip(micro, values):
        batch[key] = value


# ---- DPO, ORPO, SimPO ----------------------------------------------------------------------------------
def _pair_sequences(sample) -> list:
    return [with_response_mask(sample.chosen, sample.chosen_start),
            with_response_mask(sample.rejected, sample.rejected_start)]


def _halves(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = values.shape[0] // 2
    return values[:pairs], values[pairs:]


class DPO(PreferenceAlgorithm):
    """DPO and its variants (`functional.dpo_loss`), with an optional SFT term on the chosen
    response: loss = dpo_loss + sft_weight * (-log pi(y_c|x)), the log-probs summed or averaged
    over the response tokens (`average_logprobs`) in both terms, as in NeMo-Aligner. Count: pairs.
    Metrics (means over pairs): loss, loss/preference and loss/sft (with an SFT term), accuracy
    (chosen reward above rejected, ties 1/2), reward/chosen and reward/rejected (beta (pi - ref)),
    reward/margin, logps/chosen and logps/rejected (the policy's, as reduced)."""

    uses_reference = True

    def __init__(self, cfg):
        self.cfg = cfg
        self.loss_type = cfg.loss_type.value if hasattr(cfg.loss_type, "value") else str(cfg.loss_type)
        self.rewards = self.loss_type.startswith("rpo")

    def sequences(self, sample) -> list:
        return _pair_sequences(sample)

    def annotate(self, trainer, samples, groups, micro, length) -> None:
        attach(micro, "reference", trainer.reference_logprobs(groups, self.sequences, micro, length))
        if self.rewards:
            attach(micro, "chosen_rewards", [torch.tensor([s.chosen_reward for s in g]) for g in groups])
            attach(micro, "rejected_rewards", [torch.tensor([s.rejected_reward for s in g]) for g in groups])

    def loss(self, sums, counts, batch):
        c = self.cfg
        reduce = (lambda x: x / counts.clamp(min=1)) if c.average_logprobs else (lambda x: x)
        policy_c, policy_r = _halves(reduce(sums))
        ref_c, ref_r = _halves(reduce(batch["reference"].to(sums)))
        losses = F.dpo_loss(policy_c, policy_r, ref_c, ref_r, c.beta, self.loss_type, c.label_smoothing,
                            batch.get("chosen_rewards"), batch.get("rejected_rewards"), c.reward_scale)
        reward_c, reward_r = c.beta * (policy_c - ref_c).detach(), c.beta * (policy_r - ref_r).detach()
        report = {"accuracy": F.preference_accuracy(reward_c, reward_r).sum(), "reward/chosen": reward_c.sum(),
                  "reward/rejected": reward_r.sum(), "reward/margin": (reward_c - reward_r).sum(),
                  "logps/chosen": policy_c.detach().sum(), "logps/rejected": policy_r.detach().sum()}
        if c.sft_weight:
            report["loss/preference"] = losses.detach().sum()
            report["loss/sft"] = -policy_c.detach().sum()
            losses = losses - c.sft_weight * policy_c
        loss = losses.sum()
        report["loss"] = loss.detach()
        return loss, torch.tensor(policy_c.shape[0], device=sums.device), report


class ORPO(PreferenceAlgorithm):
    """ORPO (`functional.orpo_loss`) on length-averaged log-probs; reference-free. Metrics: loss,
    loss/nll, loss/odds_ratio, accuracy (chosen mean log-prob above rejected), log_odds_ratio,
    logps/chosen, logps/rejected (mean per token)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def sequences(self, sample) -> list:
        return _pair_sequences(sample)

    def loss(self, sums, counts, batch):
        chosen, rejected = _halves(sums / counts.clamp(min=1))
        losses = F.orpo_loss(chosen, rejected, self.cfg.odds_ratio_weight)
        odds = (F.log_odds(chosen) - F.log_odds(rejected)).detach()
        loss = losses.sum()
        report = {"loss": loss.detach(), "loss/nll": -chosen.detach().sum(),
                  "loss/odds_ratio": -torch.nn.functional.logsigmoid(odds).sum(),
                  "accuracy": F.preference_accuracy(chosen.detach(), rejected.detach()).sum(),
                  "log_odds_ratio": odds.sum(), "logps/chosen": chosen.detach().sum(),
                  "logps/rejected": rejected.detach().sum()}
        return loss, torch.tensor(chosen.shape[0], device=sums.device), report


class SimPO(PreferenceAlgorithm):
    """SimPO (`functional.simpo_loss`) on length-averaged log-probs; reference-free. Metrics: loss,
    accuracy, reward/chosen and reward/rejected (beta x mean log-prob), reward/margin, logps/*."""

    def __init__(self, cfg):
        self.cfg = cfg

    def sequences(self, sample) -> list:
        return _pair_sequences(sample)

    def loss(self, sums, counts, batch):
        c = self.cfg
        chosen, rejected = _halves(sums / counts.clamp(min=1))
        loss = F.simpo_loss(chosen, rejected, c.beta, c.gamma, c.label_smoothing).sum()
        reward_c, reward_r = c.beta * chosen.detach(), c.beta * rejected.detach()
        report = {"loss": loss.detach(), "accuracy": F.preference_accuracy(reward_c, reward_r).sum(),
                  "reward/chosen": reward_c.sum(), "reward/rejected": reward_r.sum(),
                  "reward/margin": (reward_c - reward_r).sum(), "logps/chosen": chosen.detach().sum(),
                  "logps/rejected": rejected.detach().sum()}
        return loss, torch.tensor(chosen.shape[0], device=sums.device), report


# ---- KTO ------------------------------------------------------------------------------------------------
class KTO(PreferenceAlgorithm):
    """KTO (`functional.kto_loss`) on unpaired samples with summed log-probs. Each step first
    estimates the reference point z0 over the whole global batch (so it does not depend on the
    micro-batch or DP split): the policy's and the reference's log-probs of every sample's mismatched
    sequence (`aligner.data.preference`), no grad. Count: samples. Metrics: loss, kl (z0),
    reward/desirable and reward/undesirable (mean beta (pi - ref) over each class of the global
    batch), reward/margin (their difference), logps/desirable, logps/undesirable, and
    fraction/desirable."""

    uses_reference = True

    def __init__(self, cfg):
        self.cfg = cfg

    def sequences(self, sample) -> list:
        return [with_response_mask(sample.ids, sample.start)]

    def reference_sequences(self, sample) -> list:
        return [with_response_mask(sample.ids, sample.start), with_response_mask(sample.kl_ids, sample.kl_start)]

    def annotate(self, trainer, samples, groups, micro, length) -> None:
        from megatron.core import parallel_state as ps

        reference = trainer.reference_logprobs(groups, self.reference_sequences)
        kl_micro, kl_length = trainer.micro_batches(groups, lambda s: self.reference_sequences(s)[1:])
        policy_kl = logprob_sums(trainer.model, kl_micro, kl_length, trainer.vocab_size)
        desirable = sum(s.desirable for s in samples)
        for g, batch, ref, pol in zip(groups, micro, reference, policy_kl):
            batch["reference"], batch["kl_gap"] = ref[:len(g)], (pol - ref[len(g):].to(pol)).sum()
            batch["desirable"] = torch.tensor([s.desirable for s in g])
            # weights turning per-sample sums into class means over the global batch
            batch["class_weight"] = torch.tensor([len(samples) / desirable if s.desirable
                                                  else len(samples) / (len(samples) - desirable) for s in g])
            batch["fraction_desirable"] = torch.tensor(desirable / len(samples))
        if ps.is_pipeline_last_stage():
            gap = sum(b["kl_gap"] for b in micro)
            dist.all_reduce(gap, group=ps.get_data_parallel_group())  # the same on every CP/TP rank already
            kl = F.kto_kl_estimate(gap, len(samples))
            attach(micro, "kl", [kl] * len(micro))

    def loss(self, sums, counts, batch):
        c = self.cfg
        ref = batch["reference"].to(sums)
        desirable = batch["desirable"]
        losses = F.kto_loss(sums, ref, desirable, batch["kl"], c.beta, c.desirable_weight, c.undesirable_weight)
        loss = losses.sum()
        reward = c.beta * (sums - ref).detach()
        weight = batch["class_weight"].to(sums)
        d, u = desirable.float(), (~desirable).float()
        report = {"loss": loss.detach(), "kl": batch["kl"] * len(sums),
                  "reward/desirable": (reward * weight * d).sum(), "reward/undesirable": (reward * weight * u).sum(),
                  "reward/margin": (reward * weight * (d - u)).sum(),
                  "logps/desirable": (sums.detach() * weight * d).sum(),
                  "logps/undesirable": (sums.detach() * weight * u).sum(),
                  "fraction/desirable": batch["fraction_desirable"] * len(sums)}
        return loss, torch.tensor(len(sums), device=sums.device), report


class SFTObjective(PreferenceAlgorithm):
    """SFT's next-token NLL through the sequence machinery, for packed SFT batches: one sequence per
    sample, loss = -(sum of its loss-token log-probs), count = loss tokens (as padded SFT)."""

    def sequences(self, sample) -> list:
        return [(sample.ids, sample.loss_mask)]

    def loss(self, sums, counts, batch):
        loss = -sums.sum()
        return loss, counts.sum(), {"loss": loss.detach()}


def packing_enabled(cfg) -> bool:
    """Whether a run packs its batches: `data.packing` true or false, or null (auto): packed on the
    local layer spec, padded on the Transformer-Engine spec (said in the log). Packed and padded
    batches give the same results; packing only saves work."""
    from aligner.models.gpt import use_transformer_engine

    engine = use_transformer_engine(cfg.model.transformer_impl)
    if cfg.data.packing is None:
        if engine:
            log.info("data.packing=null (auto): padded batches, since the Transformer-Engine attention takes no "
                     "tree masks")
        return not engine
    if cfg.data.packing and engine:
        raise ValueError("data.packing=true needs the local layer spec (model.transformer_impl=local): the "
                         "Transformer-Engine attention ignores the block-causal mask and its THD packed format "
                         "is not wired in yet; data.packing=null packs only where it can")
    return bool(cfg.data.packing)


# ---- entry point ------------------------------------------------------------------------------------------
def run(cfg, algorithm: PreferenceAlgorithm, unpaired: bool = False) -> None:
    """One rank of `aligner train <dpo|orpo|simpo|kto>` with a validated config."""
    from aligner.data.preference import load_preference_dataset, load_unpaired_dataset
    from aligner.data.tokenizer import load_tokenizer, model_vocab_size
    from aligner.models.training import wrap_for_training
    from aligner.runtime import distributed

    m, d = cfg.model, cfg.data
    packed = packing_enabled(cfg)
    distributed.start_training_rank(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path)
    vocab_size = model_vocab_size(m, tokenizer, cfg.tokenizer.path)

    def load(path):
        if unpaired:
            return load_unpaired_dataset(path, tokenizer, d.format, d.max_length, d.overlong)
        return load_preference_dataset(path, tokenizer, d.format, d.max_length, d.overlong,
                                       rewards=getattr(algorithm, "rewards", False))

    train, val = load(d.train_path), (load(d.val_path) if d.val_path else None)
    model, optimizer, scheduler = wrap_for_training(build_policy(m, vocab_size), m, cfg.optim)
    packing = {"packed": packed, "capacity": d.pack_length}
    mode = cfg.reference.mode if "reference" in cfg else None
    mode = getattr(mode, "value", mode)
    step = make_sequence_forward_step(algorithm.loss, vocab_size)
    trainer = PreferenceTrainer(cfg, model, optimizer, scheduler, step, train, val,
                                PreferenceFormat(algorithm, tokenizer.pad_token_id), vocab_size, tokenizer,
                                algorithm=algorithm, reference_mode=mode, packing=packing)
    trainer.fit()
    distributed.shutdown()
