"""`aligner convert`: Hugging Face safetensors directories <-> aligner (megatron dist-checkpoint) dirs.

hf_to_mcore  runs tp*pp ranks (in this process when that is 1); each builds its stage of the
             model, reads only the HF tensors its parameters are made of (safe_open, so sharded
             checkpoints with model.safetensors.index.json work and nothing else is loaded),
             fills its TP shards and joins the collective save. The tokenizer files are copied
             into <out>/tokenizer and the HF architecture / config.json / generation_config.json
             are kept in aligner.json under "hf", so the checkpoint is self-contained.
mcore_to_hf  builds the model from the checkpoint metadata (TP=PP=1 unless asked; the
             dist-checkpoint reshards on load) and writes config.json plus safetensors shards
             (with an index when there are several) from `iter_hf_weights`, plus the tokenizer. A LoRA
             checkpoint exports merged (its base with the adapters added), or with lora="adapter" as a
             PEFT adapter directory (lora_peft.py), read in this process without building the model.
hf_to_mcore with `lora` (a PEFT adapter directory) writes the base at <out>/base and a LoRA checkpoint
             starting from the adapter at <out>/lora (adapters only, its base named by path and fingerprint).
Both entry points are importable without torch.distributed being initialised. With one rank they
run in the calling process, where dist_checkpointing starts a multiprocessing helper by *spawn*:
a script calling them needs the usual `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from aligner.config.schema import ModelConfig
from aligner.data.tokenizer import load_tokenizer
from aligner.errors import UserError
from aligner.files import atomic_directory
from aligner.launch.ranks import rank_main, run_ranks, single_process
from aligner.models import hf_weights as hw
from aligner.models import lora, lora_peft
from aligner.models.checkpoint import (is_complete, load_weights, lora_base, model_config_from_checkpoint,
                                      read_metadata, save_checkpoint, scalar_head_outputs)
from aligner.models.gpt import build_gpt, layer_offset
from aligner.observe.progress import Progress

# megatron, and the modules that import it, are imported inside the rank functions: `aligner convert`
# imports this module in the CLI process, which with several ranks only launches them (megatron costs
# seconds there and prints its apex/TE warnings).

# Files of a HF model directory that belong to its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
DEFAULT_SHARD_BYTES = 2 * 10**9


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def read_hf_config(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise UserError(f"{hf_dir} has no config.json" if Path(hf_dir).exists() else f"{hf_dir} does not exist",
                        "the Hugging Face model directory", "pass a directory with config.json and *.safetensors")
    return json.loads(path.read_text())


class SafetensorsReader:
    """Lazy access to the tensors of a HF directory (single file or index + shards)."""

    def __init__(self, hf_dir):
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            self.files = {name: hf_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        elif (hf_dir / "model.safetensors").exists():
            with safe_open(hf_dir / "model.safetensors", "pt") as f:
                self.files = {name: hf_dir / "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}; only "
                                    "safetensors checkpoints are supported (re-save with safe_serialization=True)")
        self._open = {}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"tensor {name} is not in the checkpoint")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, "pt")
        return self._open[path].get_tensor(name)


class TokenizerFiles:
    """Stands in for a tokenizer in `save_checkpoint(tokenizer=...)`: saving copies the files."""

    def __init__(self, src_dir, names=TOKENIZER_FILES):
        self.files = [Path(src_dir) / n for n in names if (Path(src_dir) / n).is_file()]

    def save_pretrained(self, dst_dir) -> None:
        Path(dst_dir).mkdir(parents=True, exist_ok=True)
        for f in self.files:
            shutil.copy2(f, Path(dst_dir) / f.name)


def _check_layout(fields: dict, tp: int, pp: int) -> None:
    sizes = {"num_attention_heads": fields["num_attention_heads"], "num_key_value_heads": fields["num_query_groups"],
             "intermediate_size": fields["ffn_hidden_size"]}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(f"TP={tp} must divide {', '.join(bad)}")
    if fields["num_layers"] % pp:
        raise ValueError(f"PP={pp} must divide num_hidden_layers={fields['num_layers']}")


def _model_config(fields: dict, tp: int, pp: int):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), fields,
                           {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp})


def _fresh_output_dir(out_dir) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not empty; choose a new output directory")
    return out


# ---------------------------------------------------------------------------------------------
# HF -> megatron
# ---------------------------------------------------------------------------------------------
def hf_to_mcore(hf_dir, out_dir, tp: int = 1, pp: int = 1, params_dtype: str | None = None,
                lora_dir=None) -> Path:
    """Import a HF Llama / Qwen2 / Mistral directory as an aligner checkpoint saved at TP x PP.
    `params_dtype` (float32 | bfloat16) defaults to the HF dtype (bfloat16 stays bfloat16, else float32).
    `lora_dir`, a PEFT adapter of that model: the base goes to <out_dir>/base, and <out_dir>/lora is a LoRA
    checkpoint holding the adapter (exactly; q/k/v or gate/up with different A's at a larger rank)."""
    hf_config = read_hf_config(hf_dir)
    fields = hw.model_fields_from_hf(hf_config)  # clear errors before any rank starts
    _check_layout(fields, tp, pp)
    SafetensorsReader(hf_dir)
    if lora_dir:
        if hw.hf_architecture(hf_config) in hw.SEQUENCE_CLASSIFICATION:
            raise lora_peft.PeftAdapterError(f"{hf_dir} is a reward model; only causal-LM adapters import", "--lora")
        lora_peft.read_dir(lora_dir, hw.Geometry.of(_model_config(fields, 1, 1), fields["vocab_size"]))
        _fresh_output_dir(out_dir)
    run_ranks("aligner.models.hf_convert:_import_main",
              [str(hf_dir), str(out_dir), params_dtype or "", str(lora_dir or ""), str(tp), str(pp)], tp * pp)
    return Path(out_dir)


def _import_main(argv: list[str], initialised: bool = False) -> None:
    rank_main(argv, initialised, import_rank)


@torch.no_grad()
def import_rank(hf_dir, out_dir, params_dtype: str = "", lora_dir: str = "", *, tp: int, pp: int) -> None:
    """Collective, in a process group already set up for (tp, pp): build, fill, save (and with `lora_dir`,
    the base at <out_dir>/base, then the same model with the PEFT adapter's adapters at <out_dir>/lora)."""
    from megatron.core import parallel_state as ps  # megatron: on the ranks only (module comment)

    from aligner.runtime.seeding import seed_everything  # imports megatron

    hf_config = read_hf_config(hf_dir)
    fields = hw.model_fields_from_hf(hf_config)
    if params_dtype:
        fields["params_dtype"] = params_dtype
    cfg = _model_config(fields, tp, pp)
    vocab = fields["vocab_size"]
    reader, offset, tp_rank = SafetensorsReader(hf_dir), layer_offset(cfg), ps.get_tensor_model_parallel_rank()
    # a *ForSequenceClassification reward model: its `score` head becomes our (replicated) scalar head
    score = reader.get("score.weight").shape[0] if hw.hf_architecture(hf_config) in hw.SEQUENCE_CLASSIFICATION else 0
    seed_everything(0)  # initial values are overwritten; megatron still needs its RNG tracker seeded
    model = build_gpt(cfg, vocab)
    if score:
        from aligner.models.heads import attach_scalar_head  # imports megatron

        attach_scalar_head(model, score)
    g = hw.Geometry.of(cfg, vocab, score_outputs=score)
    parameters = list(model.named_parameters())
    with Progress(len(parameters), unit="tensor", desc="convert", silent=dist.get_rank() != 0) as progress:
        for name, param in parameters:
            canonical = hw.canonical_name(name, offset)
            full = hw.from_hf(canonical, reader.get, g)
            replicated = score and canonical == "output_layer.weight"
            param.copy_(full if replicated else hw.shard(canonical, full, tp, tp_rank))
            progress.update()
    generation = Path(hf_dir) / "generation_config.json"
    extra = {"hf": {"architecture": hw.hf_architecture(hf_config), "config": hf_config,
                    "generation_config": json.loads(generation.read_text()) if generation.exists() else None}}
    if score:
        labels = [str(v) for _, v in sorted((hf_config.get("id2label") or {}).items(), key=lambda kv: int(kv[0]))]
        named = len(labels) == score and labels != [f"LABEL_{i}" for i in range(score)]
        extra["scalar_head"] = {"num_outputs": score, "attributes": labels if named else None, "loss": None}
    tokenizer = TokenizerFiles(hf_dir)
    tokenizer = tokenizer if tokenizer.files else None
    base = Path(out_dir) / "base" if lora_dir else out_dir
    save_checkpoint(base, model, cfg, vocab, head="reward" if score else "lm", tokenizer=tokenizer, extra_meta=extra)
    if lora_dir:
        settings = _add_peft_adapters(model, lora_dir, hw.Geometry.of(cfg, vocab, tp=1), offset)
        model_cfg = {**OmegaConf.to_container(cfg, resolve=True), "lora": settings, "pretrained": str(base)}
        save_checkpoint(Path(out_dir) / "lora", model, model_cfg, vocab, tokenizer=tokenizer, extra_meta=extra)


def _add_peft_adapters(model, lora_dir, g: hw.Geometry, offset: int) -> dict:
    """Adapters on `model` (this stage, this TP rank's shards) holding PEFT adapter `lora_dir`'s; returns their
    "lora" settings. A layer the adapter leaves out keeps a fresh adapter (B = 0: no change)."""
    from megatron.core import parallel_state as ps  # megatron: on the ranks only (module comment)

    settings, adapters = lora_peft.read_dir(lora_dir, g)
    lora.add_adapters(model, settings)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, adapter in lora.adapters(model):
        weight = hw.canonical_name(f"{name}.weight", offset)
        key = (int(weight.split(".")[2]), adapter.target)
        if key in adapters:
            a, b = adapters[key]
            adapter.a.copy_(a if adapter.column else hw.shard(weight, a, tp, tp_rank))
            adapter.b.copy_(hw.shard(weight, b, tp, tp_rank) if adapter.column else b)
    return settings


# ---------------------------------------------------------------------------------------------
# megatron -> HF
# ---------------------------------------------------------------------------------------------
def mcore_to_hf(ckpt_dir, out_dir, dtype: str | None = None, *, tp: int = 1, pp: int = 1,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, lora_mode: str = "merged") -> Path:
    """Export an aligner checkpoint as a HF directory that `from_pretrained` loads: a language model
    as `*ForCausalLM`, a reward model as `*ForSequenceClassification`. `dtype` (float32 | bfloat16 |
    float16) defaults to the checkpoint's parameter dtype; `tp`/`pp` spread a model too large for
    one device over several ranks. A LoRA checkpoint exports merged, or with `lora_mode="adapter"` as a
    PEFT adapter directory for its base's export (`export_peft_adapter`)."""
    if lora_mode not in ("merged", "adapter"):
        raise ValueError(f"lora_mode must be 'merged' or 'adapter', got {lora_mode!r}")
    if lora_mode == "adapter":
        return export_peft_adapter(ckpt_dir, out_dir, dtype)
    head = read_metadata(ckpt_dir).get("head", "lm")
    if head not in ("lm", "reward"):
        raise ValueError(f"{ckpt_dir} has a '{head}' head; only language and reward models export to HF")
    out = _fresh_output_dir(out_dir)
    run_ranks("aligner.models.hf_convert:_export_main",
              [str(ckpt_dir), str(out), dtype or "", str(max_shard_bytes), str(tp), str(pp)], tp * pp)
    return out


def export_peft_adapter(ckpt_dir, out_dir, dtype: str | None = None) -> Path:
    """A LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors), for `PeftModel.from_pretrained` on the HF export of its base. Reads only
    the adapters, whole (dist_checkpointing reshards any saved layout), in this process."""
    meta = read_metadata(ckpt_dir)
    if "lora" not in meta:
        raise lora_peft.PeftAdapterError(f"{ckpt_dir} is not a LoRA checkpoint (its aligner.json has no \"lora\")",
                                         "--lora adapter", "export it without --lora adapter")
    if meta.get("head", "lm") != "lm":
        raise lora_peft.PeftAdapterError(f"{ckpt_dir} has a '{meta['head']}' head; only language-model adapters "
                                         "export to PEFT", "--lora adapter", "export it merged (--lora merged)")
    base = lora_base(ckpt_dir, meta)  # refused when gone or changed: the adapters only mean something on it
    cfg, vocab = model_config_from_checkpoint(ckpt_dir)
    out = _fresh_output_dir(out_dir)
    with single_process():
        adapters = _checkpoint_adapters(ckpt_dir)
    tensors = lora_peft.peft_tensors(adapters, hw.Geometry.of(cfg, vocab, tp=1))
    if dtype:
        tensors = {k: t.to(getattr(torch, dtype)) for k, t in tensors.items()}
    return lora_peft.write_dir(out, lora_peft.peft_config(meta["lora"], base), tensors)


# dist_checkpointing's key of a LoRA matrix: the layers stacked on a first axis (global layer numbers)
_ADAPTER_KEY = re.compile(r"^decoder\.layers\.(?:self_attention|mlp)\.(linear_\w+)\.lora\.([ab])$")


def _checkpoint_adapters(ckpt_dir) -> dict:
    """{(layer, target): (A, B)}, whole (TP=1 layout), from a LoRA checkpoint's weights/; needs a process group."""
    from megatron.core import dist_checkpointing  # megatron: on the ranks only (module comment)

    weights = str(Path(ckpt_dir) / "weights")
    saved = dist_checkpointing.load_tensors_metadata(weights)
    wanted = {k: v for k, v in saved.items() if _ADAPTER_KEY.match(k)}
    unknown = [k for k in saved if lora.is_adapter_parameter(k) and k not in wanted and not k.startswith("optimizer.")]
    if unknown or not wanted:  # a layout this reader does not know: a bug to fix here, not the user's mistake
        raise ValueError(f"{ckpt_dir}: adapter entries {unknown or 'absent'}; expected {_ADAPTER_KEY.pattern}")
    found = {}
    for key, stacked in dist_checkpointing.load(wanted, weights, validate_access_integrity=False).items():
        target, which = _ADAPTER_KEY.match(key).groups()
        for layer, tensor in enumerate(stacked):
            found.setdefault((layer, target), {})[which] = tensor
    return {key: (ab["a"], ab["b"]) for key, ab in found.items()}


def _export_main(argv: list[str], initialised: bool = False) -> None:
    rank_main(argv, initialised, export_rank)


def export_rank(ckpt_dir, out_dir, dtype: str = "", max_shard_bytes: str | int = DEFAULT_SHARD_BYTES, *,
                tp: int, pp: int) -> None:
    """Collective, in a process group set up for (tp, pp): load the checkpoint, stream it to rank 0
    (`aligner.models.weight_stream`), write."""
    from aligner.models.heads import attach_scalar_head  # these three import megatron: on the ranks only
    from aligner.models.weight_stream import iter_hf_weights
    from aligner.runtime.seeding import seed_everything

    cfg, vocab = model_config_from_checkpoint(ckpt_dir, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    dtype = dtype or cfg.params_dtype
    meta = read_metadata(ckpt_dir)
    outputs = scalar_head_outputs(ckpt_dir) or 0
    seed_everything(0)
    model = build_gpt(cfg, vocab)
    if outputs:
        attach_scalar_head(model, outputs)
    load_weights(ckpt_dir, model)
    buckets = iter_hf_weights(model, cfg, vocab, dtype=dtype, bucket_bytes=int(max_shard_bytes), score_outputs=outputs)
    if dist.get_rank() != 0:
        for _ in buckets:  # take part in the stream
            pass
        return
    hf, tokenizer_dir = _hf_sources(ckpt_dir, meta)
    architecture = hf.get("architecture")
    if outputs:  # the causal-LM architecture of an imported *ForSequenceClassification
        architecture = hw.SEQUENCE_CLASSIFICATION.get(architecture, architecture)
    config = hw.hf_config_from_model(cfg, vocab, architecture, dtype, base=hf.get("config"))
    if outputs:
        _as_sequence_classification(config, meta, outputs, tokenizer_dir)
    g = hw.Geometry.of(cfg, vocab, score_outputs=outputs)
    with Progress(sum(len(hw.hf_names(n, g)) for n in hw.mcore_names(g)), unit="tensor", desc="convert") as progress:
        write_hf_dir(out_dir, config, _counted(buckets, progress), tokenizer_dir, hf.get("generation_config"))


def _hf_sources(ckpt_dir, meta: dict) -> tuple[dict, Path]:
    """(the "hf" metadata, the tokenizer directory) an export takes: the checkpoint's own, else for a LoRA
    checkpoint its base's."""
    hf, tokenizer_dir = meta.get("hf"), Path(ckpt_dir) / "tokenizer"
    base = Path(meta["lora"]["base"]["path"]) if "lora" in meta else None
    if base is not None and is_complete(base):
        hf = hf or read_metadata(base).get("hf")
        tokenizer_dir = tokenizer_dir if tokenizer_dir.is_dir() else base / "tokenizer"
    return hf or {}, tokenizer_dir


def _counted(buckets, progress):
    """The buckets, each one's tensors counted once write_hf_dir has saved it (max_shard_bytes a step)."""
    for bucket in buckets:
        yield bucket
        progress.update(n=len(bucket))


def _as_sequence_classification(config: dict, meta: dict, outputs: int, tokenizer_dir: Path) -> None:
    """A causal-LM config.json -> `<Llama|Qwen2|Mistral>ForSequenceClassification`'s. Hugging Face
    reads the reward at the last token that is not `pad_token_id`, we at the last real token: the
    two agree unless the pad token is also the token a scored sequence ends with."""
    labels = (meta.get("scalar_head") or {}).get("attributes") or [f"LABEL_{i}" for i in range(outputs)]
    config.update(architectures=[{v: k for k, v in hw.SEQUENCE_CLASSIFICATION.items()}[config["architectures"][0]]],
                  id2label={str(i): label for i, label in enumerate(labels)},
                  label2id={label: i for i, label in enumerate(labels)})
    if config.get("pad_token_id") is None and tokenizer_dir.is_dir():  # HF needs it for batches of > 1
        config["pad_token_id"] = load_tokenizer(tokenizer_dir).pad_token_id


def write_hf_dir(out_dir, config: dict, buckets, tokenizer_dir=None, generation_config: dict | None = None) -> Path:
    """Write config.json, one safetensors shard per non-empty bucket (model.safetensors when there
    is only one, else model-0000i-of-0000n.safetensors + index) and the tokenizer files, into a
    `.partial` directory renamed to `out_dir` at the end."""
    with atomic_directory(out_dir) as partial:  # an existing out_dir was checked empty by the caller
        _fill_hf_dir(partial, config, buckets, tokenizer_dir, generation_config)
    return Path(out_dir)


def _fill_hf_dir(partial: Path, config: dict, buckets, tokenizer_dir, generation_config: dict | None) -> None:
    shards, total = [], 0
    for bucket in buckets:
        if not bucket:
            continue
        tensors = {name: t.detach().cpu().contiguous() for name, t in bucket.items()}
        path = partial / f"shard-{len(shards)}.tmp"
        save_file(tensors, str(path), metadata={"format": "pt"})
        shards.append((path, list(tensors)))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map = {}
    for i, (path, names) in enumerate(shards):
        final = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(path, partial / final)
        weight_map.update(dict.fromkeys(names, final))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config:
        (partial / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and f.name != "config.json":
                shutil.copy2(f, partial / f.name)
