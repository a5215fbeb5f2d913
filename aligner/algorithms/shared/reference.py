"""The frozen reference model of the preference trainers and RL: the policy's initial weights
(`model.pretrained`, or the seeded initialisation). `reference.mode` says where it lives:
* `model`: a second GPTModel with the policy's layout (memory: one more copy of the weights).
* `cpu_swap`: its weights stay in CPU memory and are copied into the policy for the reference pass,
  then the policy's weights are copied back (`aligner.models.weight_swap`; memory: none on the device, at
  no point: they are taken from the policy before it trains, not from a second model).
* `precompute`: its log-probs are computed once for every sample before training, by a `cpu_swap`
  reference, and cached in `<run_dir>/reference/<split>.pt` (keyed by a fingerprint of the tokens and of
  the reference), so a resumed run reads them back; no reference weights are kept during training.
A LoRA run (`model.lora.rank > 0`) has no reference weights of its own: its reference is the policy
with its adapters off, the frozen base (`adapters`); after SPIN renews it, a copy of the adapters at
that point (tensors of rank r) is swapped in for the reference pass instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import Float16Module

from aligner.algorithms.shared.sequence_logprobs import interleave, logprob_sums
from aligner.data.packing import build_micro_batches
from aligner.models import checkpoint, lora
from aligner.models.policy import build_policy
from aligner.models.weight_swap import CpuWeights, copy_weights
from aligner.runtime import collectives

log = logging.getLogger(__name__)


def named_parameters(model) -> dict[str, torch.nn.Parameter]:
    """The parameters of a (possibly DDP/Float16-wrapped) model by name."""
    return dict(checkpoint.unwrap(model).named_parameters())


class Reference:
    """The frozen initial policy, as a second model (`model`), as CPU weights swapped into the
    policy (`cpu_swap`), or as the policy's base, its adapters off (`adapters`, a LoRA run). Build it
    before the trainer resumes, while the policy holds its initial weights; with `pretrained` those
    are loaded from the checkpoint instead."""

    def __init__(self, mode: str, policy, model_cfg, vocab_size: int, pretrained: str | None):
        self.mode, self.policy, self.vocab_size = mode, policy, vocab_size
        if mode == "adapters":
            self.model, self.adapters = None, None  # None: the base itself
            return
        if mode == "cpu_swap":
            # no second model, whose weights would occupy the device while they are copied out: the policy's own
            # initial weights, `pretrained` loaded into it first (the trainer loads them again as it resumes)
            if pretrained:
                checkpoint.load_weights(pretrained, policy)
            params = named_parameters(policy)
            self.weights, self.backup = CpuWeights(params), CpuWeights(params, copy=False)
            self.model = None
            return
        model = build_policy(model_cfg, vocab_size)
        if pretrained:
            checkpoint.load_weights(pretrained, model)
        else:
            copy_weights(named_parameters(policy), named_parameters(model))
        for p in model.parameters():
            p.requires_grad_(False)
        if model_cfg.params_dtype == "bfloat16":
            model = Float16Module(model.config, model)
        model.eval()
        self.model = model

    def load_from(self, params: dict[str, torch.Tensor]) -> None:
        """Make `params` (a model's named parameters) the reference weights (SPIN renews it)."""
        if self.mode == "adapters":  # the base is shared and frozen: only the adapters differ
            self.adapters = {n: p.detach().clone() for n, p in params.items() if lora.is_adapter_parameter(n)}
        elif self.mode == "cpu_swap":
            self.weights.save(params)
        else:
            copy_weights(params, named_parameters(self.model))

    @contextlib.contextmanager
    def _swapped_in(self):
        params = named_parameters(self.policy)
        self.backup.save(params)
        self.weights.load_into(params)
        try:
            yield self.policy
        finally:
            self.backup.load_into(params)

    @contextlib.contextmanager
    def _adapters_swapped(self):
        if self.adapters is None:
            with lora.disabled(self.policy):
                yield self.policy
            return
        params = named_parameters(self.policy)
        live = {n: params[n].detach().clone() for n in self.adapters}
        with torch.no_grad():
            copy_weights(self.adapters, params)
        try:
            yield self.policy
        finally:
            with torch.no_grad():
                copy_weights(live, params)

    def run(self, forward):
        """`forward(model)` with the reference weights (its own model, or swapped into the policy)."""
        context = (self._swapped_in() if self.mode == "cpu_swap" else self._adapters_swapped()
                   if self.mode == "adapters" else contextlib.nullcontext(self.model))
        with context as model:
            return forward(model)

    def logprob_sums(self, micro_batches: list[dict], length: int) -> list[torch.Tensor]:
        return self.run(lambda model: logprob_sums(model, micro_batches, length, self.vocab_size))


def build_reference(cfg, policy, vocab_size: int, mode: str | None) -> Reference:
    """The run's reference in `mode` (`model`, the default, or `cpu_swap`): `cfg.model.pretrained`'s weights,
    else the policy's initial ones; in a LoRA run the policy's base (config validation refused any
    other explicit mode). Every trainer builds its reference here."""
    m = cfg.model
    mode = "adapters" if lora.enabled(m.lora) else (mode or "model")
    return Reference(mode, policy, m, vocab_size, m.pretrained)


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
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n, k = len(dataset), len(sequences_of(dataset[0]))
    per_rank = -(-n // dp)
    mine = list(range(dp_rank * per_rank, min(n, (dp_rank + 1) * per_rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    table = torch.zeros(n, k, dtype=torch.float32, device=device)
    # Enough micro-batches per schedule call to amortise the pipeline, few enough to bound padding.
    for start in range(0, len(mine), 8 * micro_batch_size):
        chunk = mine[start:start + 8 * micro_batch_size]
        groups = [chunk[i:i + micro_batch_size] for i in range(0, len(chunk), micro_batch_size)]
        seqs = [interleave([sequences_of(dataset[i]) for i in g]) for g in groups]
        micro, length = build_micro_batches(seqs, pad_id, pairs=k == 2, **packing)
        for g, sums in zip(groups, reference.logprob_sums(micro, length)):
            table[g] = sums.view(k, len(g)).t().to(table.dtype)
    contributes = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_context_parallel_rank() == 0)
    if not contributes:
        table.zero_()
    collectives.all_reduce(table)
    return table.cpu()


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
    collectives.barrier()
    return dataset.with_reference(values.tolist())
