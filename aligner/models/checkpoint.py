"""Checkpoints: megatron `dist_checkpointing` weights (reshardable to any TP/PP) plus our metadata.

Layout of a checkpoint directory:
    aligner.json          model architecture, vocabulary size, head kind, trainer state (step, data position, ...)
    weights/              dist_checkpointing of {"model": ..., "optimizer": ...}
    rank_state/rank_<r>.pt  per-rank RNG states, by the device they belong to (runtime/seeding.py)
    tokenizer/            the Hugging Face tokenizer, when one was given
    COMPLETE              written last
A checkpoint is first written to `<dir>.partial` and renamed once every rank has finished, so a
process that dies mid-save never leaves a directory that looks complete. Weights written with one layer
spec load with the other: every load checks the model's keys one by one (checkpoint_keys.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from aligner.config.schema import ModelConfig
from aligner.errors import UserError
from aligner.files import partial_path
from aligner.models import checkpoint_keys, lora
from aligner.models.gpt import build_gpt
from aligner.runtime import collectives

log = logging.getLogger(__name__)

# megatron is imported inside the functions: the CLI process imports this module before it launches ranks or
# loads a model (`aligner serve`'s checks read checkpoint metadata; `aligner generate` and `aligner export` import
# it before they parse their arguments), and importing megatron there costs seconds and prints apex/TE warnings.

FORMAT_VERSION = 1


class NotACheckpoint(UserError, FileNotFoundError):
    """A path given as a checkpoint holds none (or an incomplete one)."""
# Distributed-optimizer state: one shard per DP rank, written in parallel with no gather. Such a
# state resumes at the same TP/PP (any DP); the model weights themselves load at any layout.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
HEAD_PREFIX = "output_layer."  # the output layer's entries: a language model's or a scalar head's
# how a model was run, not what it is: kept out of aligner.json's "model" (a run's own config decides them)
PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "sequence_parallel", "recompute")


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        collectives.barrier()


def _collect_write_results_in_process() -> None:
    """megatron's torch_dist writer passes its write results through a module-level queue that, unless one
    exists, it creates on the first save inside a multiprocessing Manager started with 'spawn': a fresh
    interpreter per process (1.5-2.3 s on a 2-core box, for every run that saves). We save synchronously, so
    the queue is only written and read in this process (its forked writers report through their own local
    queue), and an in-process queue does the same job."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # megatron: see the note at the top

    if hasattr(filesystem_async, "_results_queue") and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(path, model, model_cfg, vocab_size: int, *, optimizer=None, trainer_state: dict | None = None,
                    rank_state: dict | None = None, head: str = "lm", tokenizer=None,
                    extra_meta: dict | None = None, lora_base: str | None = None) -> Path:
    """Collective: every rank calls it. Returns the published directory. `extra_meta` adds
    top-level entries to aligner.json (e.g. "hf": the imported model's HF architecture/config).
    A model with LoRA adapters saves only its trainable tensors, and names its base: `lora_base`, by
    default `model_cfg.pretrained`."""
    from megatron.core import dist_checkpointing  # megatron: see the note at the top

    _collect_write_results_in_process()
    path = Path(path)
    partial = partial_path(path)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "rank_state").mkdir(parents=True)
        (partial / "weights").mkdir()
    _barrier()
    inner = unwrap(model)
    adapted = lora.has_adapters(inner)
    # a LoRA run saves what it trains (adapters, a scalar head) and names its frozen base
    sharded = {"model": trainable_entries(inner) if adapted else inner.sharded_state_dict()}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], metadata=OPTIMIZER_METADATA)
    dist_checkpointing.save(sharded, str(partial / "weights"))
    if rank_state is not None:
        torch.save(rank_state, partial / "rank_state" / f"rank_{_rank():05d}.pt")
    if _rank() == 0:
        model_dict = OmegaConf.to_container(model_cfg, resolve=True) if not isinstance(model_cfg, dict) else dict(model_cfg)
        meta = {"format": FORMAT_VERSION, "head": head, "vocab_size": vocab_size,
                "model": {k: v for k, v in model_dict.items() if k not in PARALLEL_KEYS + ("pretrained", "lora")},
                "saved_with": {k: model_dict[k] for k in PARALLEL_KEYS},
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "trainer_state": trainer_state or {}}
        if adapted:
            meta["lora"] = lora_metadata(model_dict["lora"], lora_base or model_dict.get("pretrained"),
                                         trained_head=head != "lm")
        meta = {**(extra_meta or {}), **meta}  # our own keys always win
        (partial / "aligner.json").write_text(json.dumps(meta, indent=2))
        if tokenizer is not None:  # makes the checkpoint self-contained for `aligner logprobs` / export
            tokenizer.save_pretrained(str(partial / "tokenizer"))
    _barrier()
    if _rank() == 0:
        (partial / "COMPLETE").write_text("")
        if path.exists():
            shutil.rmtree(path)
        os.replace(partial, path)
    _barrier()
    return path


def is_complete(path) -> bool:
    path = Path(path)
    return (path / "COMPLETE").exists() and (path / "aligner.json").exists() and not path.name.endswith(".partial")


def read_metadata(path) -> dict:
    path = Path(path)
    if not is_complete(path):
        raise NotACheckpoint(f"{path} is not a complete aligner checkpoint (expected aligner.json, weights/ and "
                             f"COMPLETE)", "", "pass a checkpoint directory (<run_dir>/checkpoints/step_N), or "
                             "convert a Hugging Face model with `aligner convert hf-to-mcore`")
    return json.loads((path / "aligner.json").read_text())


def latest_checkpoint(checkpoints_dir) -> Path | None:
    """The complete checkpoint with the highest step recorded *inside* it (names are not trusted)."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return None
    found = [(read_metadata(p)["trainer_state"].get("step", -1), p) for p in root.iterdir() if is_complete(p)]
    return max(found)[1] if found else None


def _load_checked(path, inner, sharded: dict, head_unread: bool = False) -> dict:
    """Collective: dist_checkpointing.load of `sharded` ({"model": `inner`'s sharded state dict, and
    maybe "optimizer"}), with the model's keys checked one by one (checkpoint_keys.check_checkpoint_keys):
    a TE model may find its extra state absent, a model may leave the checkpoint's extra state (and, with
    `head_unread`, its output layer) unread; any other mismatch is an error naming the keys. The optimizer's
    state is left to megatron's own checks."""
    from megatron.core import dist_checkpointing  # megatron: see the note at the top
    from megatron.core.dist_checkpointing.validation import StrictHandling

    te_names = checkpoint_keys.te_extra_state_names(inner)
    te_keys = {entry.key for name, entry in sharded["model"].items() if name in te_names}
    # megatron's words: "unexpected" = requested but not in the checkpoint, "missing" = the reverse
    loaded, ckpt_only, absent = dist_checkpointing.load(sharded, str(Path(path) / "weights"),
                                                        strict=StrictHandling.RETURN_ALL)
    # what no rank read, counted over all ranks: a stage without the output layer skips it too
    unread = ("optimizer.", HEAD_PREFIX) if head_unread else ("optimizer.",)
    left_over = {k for k in ckpt_only if not k.startswith(unread)}
    absent, ignored = checkpoint_keys.check_checkpoint_keys(absent, left_over, te_keys, str(path))
    if absent:
        log.info("%s has no Transformer Engine extra state %s (written without TE): TE starts it from its defaults",
                 path, ", ".join(sorted(absent)))
    if ignored:
        log.info("%s: ignored its Transformer Engine extra state %s (this model has no TE module for it)",
                 path, ", ".join(sorted(ignored)))
    return loaded


def _load_module(inner, state: dict, path, frozen_ok: bool = False) -> None:
    """`state` into `inner`; adapters may be missing (they keep theirs), and with `frozen_ok` every
    frozen parameter (a LoRA checkpoint's base, loaded apart)."""
    missing, unexpected = inner.load_state_dict(state, strict=False)
    frozen = {n for n, p in inner.named_parameters() if not p.requires_grad} if frozen_ok else set()
    missing = [k for k in missing if not lora.is_adapter_parameter(k) and k not in frozen]
    checkpoint_keys.check_module_keys(missing, unexpected, checkpoint_keys.te_extra_state_names(inner), str(path))


def trainable_entries(inner) -> dict:
    """The sharded state dict of what trains: the adapters (and a scalar head) of a LoRA model."""
    trainable = {n for n, p in inner.named_parameters() if p.requires_grad}
    return {k: v for k, v in inner.sharded_state_dict().items() if k in trainable}


def _head_outputs(inner) -> int | None:
    """Outputs of `inner`'s scalar head (None: a language model, or a stage without the head)."""
    return getattr(getattr(inner, "output_layer", None), "num_outputs", None)


def _load_into(path, inner, num_outputs: int | None) -> bool:
    """Collective: the weights checkpoint `path` computes with into `inner`'s base parameters (its adapters
    are left as they are). `num_outputs`: the scalar head's, whose weights load only from a head of that
    size (None: a language model). A LoRA checkpoint loads its base (fingerprint-checked) and merges its
    adapters in. Returns whether the head loaded."""
    meta = read_metadata(path)
    with_head = num_outputs is None or scalar_head_outputs(path) == num_outputs
    everything = inner.sharded_state_dict()  # built once: at 405B it is a ShardedTensor per parameter
    head_keys = {k for k in everything if k.startswith(HEAD_PREFIX)}
    if "lora" not in meta:
        sharded = {k: v for k, v in everything.items()
                   if not lora.is_adapter_parameter(k) and (with_head or k not in head_keys)}
        loaded = _load_checked(path, inner, {"model": sharded}, head_unread=not with_head)["model"]
        missing, unexpected = inner.load_state_dict(loaded, strict=False)
        missing = [k for k in missing if not lora.is_adapter_parameter(k) and (with_head or k not in head_keys)]
        checkpoint_keys.check_module_keys(missing, unexpected, checkpoint_keys.te_extra_state_names(inner), str(path))
        return with_head
    head_loaded = _load_into(lora_base(path, meta), inner, num_outputs)
    saved_head = bool(meta["lora"].get("trained_head")) and with_head
    theirs = lora.new_adapters(inner, meta["lora"])
    ours = [(module, lora.attach(module, adapter)) for module, adapter in theirs]
    try:
        entries = {k: v for k, v in inner.sharded_state_dict().items()  # now with their adapters' entries
                   if lora.is_adapter_parameter(k) or (saved_head and k in head_keys)}
        head_unread = bool(meta["lora"].get("trained_head")) and not saved_head
        loaded = _load_checked(path, inner, {"model": entries}, head_unread)["model"]
        inner.load_state_dict(loaded, strict=False)
        with torch.no_grad():
            for module, _ in theirs:
                module.weight.copy_(lora.merged_weight(module))
    finally:
        for module, adapter in ours:
            lora.attach(module, adapter)
    return head_loaded or saved_head


def load_weights(path, model) -> None:
    """Load the weights `path` computes with into `model` (any TP/PP layout: dist_checkpointing reshards;
    either layer spec), a scalar head included: a LoRA checkpoint's base with its adapters merged.
    `model`'s own adapters, if any, are not touched."""
    inner = unwrap(model)
    outputs = _head_outputs(inner)
    loaded = _load_into(path, inner, outputs)
    missing = outputs if outputs is not None and not loaded else None
    if collectives.several_ranks():  # only the last stages know: every rank refuses
        missing = next((n for n in collectives.all_gather_object(missing) if n is not None), None)
    if missing is not None:
        raise checkpoint_keys.CheckpointMismatch(
            f"the checkpoint has no scalar head of {missing} output(s) for this model", str(path),
            "load a reward or value checkpoint with that head")


def load_adapted(path, model) -> None:
    """LoRA checkpoint `path` into a model with the same adapters (`lora.add_adapters` of its settings): its
    base into the frozen weights, its adapters (and trained head) into the model's own. Collective."""
    inner = unwrap(model)
    _load_into(lora_base(path), inner, _head_outputs(inner))
    loaded = _load_checked(path, inner, {"model": trainable_entries(inner)})
    _load_module(inner, loaded["model"], path, frozen_ok=True)


def scalar_head_outputs(path) -> int | None:
    """Outputs of a checkpoint's scalar head (reward or value); None for a language-model checkpoint."""
    meta = read_metadata(path)
    if meta.get("head", "lm") == "lm":
        return None
    if "scalar_head" in meta:
        return int(meta["scalar_head"]["num_outputs"])
    from megatron.core import dist_checkpointing  # megatron: see the note at the top

    tensors = dist_checkpointing.load_tensors_metadata(str(Path(path) / "weights"))
    return int(tensors["output_layer.weight"].global_shape[0])


def load_into_scalar_model(path, model, num_outputs: int) -> bool:
    """Load a checkpoint into a scalar-head model (any TP/PP): all weights when its head has
    `num_outputs` outputs, else everything but the head (a language model, or a reward model with
    other attributes), which keeps its initialisation. Collective. Returns whether the head loaded."""
    return _load_into(path, unwrap(model), num_outputs)


# ---- LoRA checkpoints: the adapters, and the base they were trained on ------------------------------------
FINGERPRINT_SAMPLE = 1 << 20


def fingerprint(path) -> str:
    """A checkpoint's identity, cheap at 405B: sha256 of aligner.json and, for each weight file, its name,
    size and first and last MiB (a retrained or rewritten base changes its metadata or its bytes)."""
    path = Path(path)
    digest = hashlib.sha256((path / "aligner.json").read_bytes())
    for file in sorted(p for p in (path / "weights").rglob("*") if p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path)} {size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(FINGERPRINT_SAMPLE))
            if size > FINGERPRINT_SAMPLE:
                f.seek(max(FINGERPRINT_SAMPLE, size - FINGERPRINT_SAMPLE))
                digest.update(f.read())
    return digest.hexdigest()[:16]


class ChangedBase(UserError):
    """A LoRA checkpoint's base is gone, or is not the one its adapters were trained on."""


def lora_metadata(lora_cfg, base, trained_head: bool) -> dict:
    """aligner.json's "lora": the adapters' settings and the base they apply to."""
    if not base:
        raise ValueError("a LoRA checkpoint needs its base: model.pretrained")
    settings = OmegaConf.to_container(lora_cfg, resolve=True) if not isinstance(lora_cfg, dict) else dict(lora_cfg)
    base = str(Path(base).resolve())
    return {**settings, "trained_head": trained_head, "base": {"path": base, "fingerprint": fingerprint(base)}}


def lora_base(path, meta: dict | None = None) -> str:
    """The base checkpoint of LoRA checkpoint `path`, refused when it changed since the adapters were saved.
    Collective where a process group exists: rank 0 reads the fingerprint's samples (at 405B, thousands of files
    that every rank would otherwise read from the shared filesystem) and every rank decides on its answer."""
    base = (meta or read_metadata(path))["lora"]["base"]
    several = collectives.several_ranks()
    lead = not several or dist.get_rank() == 0
    now = fingerprint(base["path"]) if lead and is_complete(base["path"]) else None
    if several:
        now = collectives.broadcast_object(now, src=0)
    if now is None:
        raise ChangedBase(f"the LoRA checkpoint's base {base['path']} is not a complete checkpoint any more",
                          str(path), "restore the base checkpoint at that path")
    if now != base["fingerprint"]:
        raise ChangedBase(f"the LoRA checkpoint's base {base['path']} changed since the adapters were saved: "
                          f"fingerprint {now}, expected {base['fingerprint']}", str(path),
                          "restore the base the adapters were trained on")
    return base["path"]


def _materialise_distributed_optimizer_state(optimizer) -> None:
    """megatron's DistributedOptimizer describes its state for loading from the inner optimizer's
    current state, which torch's Adam only creates at its first step (apex/TE's fused Adam create it
    up front). Take that first step with lr = weight decay = 0 and zero gradients: it creates the
    state without changing any weight, and the checkpoint's state then replaces it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # megatron: see the note at the top

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if not isinstance(part, DistributedOptimizer) or all(inner.state[p] for p in params):
            continue
        saved = [(group["lr"], group["weight_decay"]) for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, (lr, wd) in zip(inner.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, wd


def _restore_adam_step(optimizer, loaded: dict) -> None:
    """The distributed optimizer's per-parameter state template also carries torch Adam's 0-d
    `step`, which the load leaves at the placeholder value and then copies over the step it had
    restored from the param groups; re-apply that step (Adam's bias correction depends on it)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # megatron: see the note at the top

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded] if len(parts) == 1 else [loaded[k] for k in sorted(loaded)]
    for part, state in zip(parts, states):
        if not isinstance(part, DistributedOptimizer):
            continue
        steps = {group["step"] for group in state["optimizer"]["param_groups"] if "step" in group}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for param_state in part.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = torch.tensor(step)


def load_training_state(path, model, optimizer) -> tuple[dict, dict | None]:
    """Weights + optimizer state; returns (trainer_state, this rank's rank_state or None)."""
    path = Path(path)
    inner = unwrap(model)
    meta = read_metadata(path)
    if "lora" in meta:  # the frozen base first, then what trained
        _load_into(lora_base(path, meta), inner, _head_outputs(inner))
    _materialise_distributed_optimizer_state(optimizer)
    model_sd = trainable_entries(inner) if "lora" in meta else inner.sharded_state_dict()
    sharded = {"model": model_sd,
               "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)}
    loaded = _load_checked(path, inner, sharded)
    _load_module(inner, loaded["model"], path, frozen_ok="lora" in meta)
    with torch.no_grad():  # the distributed optimizer copies into leaf main params in place
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_step(optimizer, loaded["optimizer"])
    rank_file = path / "rank_state" / f"rank_{_rank():05d}.pt"
    same_world = meta["world_size"] == (dist.get_world_size() if dist.is_initialized() else 1)
    rank_state = torch.load(rank_file, weights_only=False) if same_world and rank_file.exists() else None
    return meta["trainer_state"], rank_state


def model_config_from_checkpoint(path, **parallel):
    """A ModelConfig (OmegaConf) for a checkpoint, with this run's parallel layout."""
    meta = read_metadata(path)
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), meta["model"], parallel)
    return cfg, meta["vocab_size"]


def load_language_model(path, **layout):
    """(GPTModel in eval mode, vocabulary size): checkpoint `path` built at `layout`'s parallel sizes
    (dist_checkpointing reshards the weights), for forward-only use. Seed megatron's RNG first."""
    cfg, vocab = model_config_from_checkpoint(path, **layout)
    model = build_gpt(cfg, vocab)
    load_weights(path, model)
    model.eval()
    return model, vocab
