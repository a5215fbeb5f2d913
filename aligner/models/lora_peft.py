"""Our LoRA adapters <-> Hugging Face PEFT adapter directories (adapter_config.json + adapter_model.safetensors).

Configs are dicts, tensors name -> Tensor; `read_dir` / `write_dir` are the only functions that touch files
(hf_convert.py reads our checkpoints and writes ours).

Names. An adapter of ours is (layer, target) -> (A [r, in], B [out, r]) in the base weight's TP=1 layout;
PEFT's are `base_model.model.model.layers.{i}.<self_attn|mlp>.<proj>.lora_A.weight` / `lora_B.weight`.
  linear_proj -> o_proj, linear_fc2 -> down_proj: A and B as they are.
  linear_qkv  -> q_proj, k_proj, v_proj; linear_fc1 -> gate_proj, up_proj (fused). Export: every part gets
              the shared A, and B's rows split exactly as the base weight's rows are (hf_weights.to_hf on B).
              Import: parts with identical A's (as our export writes them) fuse at their rank; other parts
              fuse exactly at a larger rank: A = the parts' A's stacked, B block-diagonal in the fused row
              layout (hf_weights.from_hf on the blocks). A part without an adapter contributes zero rows.
Scales. Ours is alpha / rank for every adapter (`module_ranks` gives a target its own rank, not its own
scale); PEFT's is lora_alpha / r per module (`rank_pattern`, `alpha_pattern`; sqrt(r) with use_rslora).
An imported module whose scale differs from the adapter's default has its B multiplied by the ratio, and
a target whose layers differ in rank is padded with zeros to the largest: both exact up to rounding.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from aligner.errors import UserError
from aligner.files import atomic_directory
from aligner.models import hf_weights as hw
from aligner.models.lora import TARGETS

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
TARGET_OF = {part: target for target, parts in PARTS.items() for part in parts}
_PARENT = {"linear_qkv": ("self_attention", "self_attn"), "linear_proj": ("self_attention", "self_attn"),
           "linear_fc1": ("mlp", "mlp"), "linear_fc2": ("mlp", "mlp")}  # megatron's, HF's
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# LoraConfig fields that change what an adapter computes beyond W + s B A, and their value when off (None, false
# and empty mean off too)
_REFUSED = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "layer_replication": None, "trainable_token_indices": None, "target_parameters": None,
            "lora_bias": False, "alora_invocation_tokens": None, "use_qalora": False, "use_bdlora": None,
            "arrow_config": None, "monteclora_config": None, "kasa_config": None}


class PeftAdapterError(UserError, ValueError):
    """A PEFT adapter our LoRA cannot represent exactly, or a LoRA checkpoint that cannot be one."""


def weight_name(layer: int, target: str) -> str:
    """The canonical megatron name of the base weight `target` of layer `layer` adapts."""
    return f"decoder.layers.{layer}.{_PARENT[target][0]}.{target}.weight"


def module_name(layer: int, part: str) -> str:
    """The HF module (as PEFT's LoraModel names it) of projection `part` in layer `layer`."""
    return f"model.layers.{layer}.{_PARENT[TARGET_OF[part]][1]}.{part}"


def part_shape(part: str, g: hw.Geometry) -> tuple[int, int]:
    """(out, in) features of an HF projection."""
    q, kv = g.heads * g.head_dim, g.groups * g.head_dim
    return {"q_proj": (q, g.hidden), "k_proj": (kv, g.hidden), "v_proj": (kv, g.hidden), "o_proj": (g.hidden, q),
            "gate_proj": (g.ffn, g.hidden), "up_proj": (g.ffn, g.hidden), "down_proj": (g.hidden, g.ffn)}[part]


# ---- export ------------------------------------------------------------------------------------------------
def peft_config(lora: dict, base: str | None) -> dict:
    """adapter_config.json for a LoRA checkpoint's "lora" metadata (a target of `module_ranks` gets its rank in
    rank_pattern and alpha * its rank / rank in alpha_pattern, so that its scale stays alpha / rank)."""
    rank, alpha = int(lora["rank"]), float(lora["alpha"])
    targets = [t for t in TARGETS if t in lora["target_modules"]]
    ranks = {t: int(r) for t, r in (lora.get("module_ranks") or {}).items() if t in targets and int(r) != rank}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
            "inference_mode": True, "r": rank, "lora_alpha": alpha, "lora_dropout": float(lora.get("dropout", 0.0)),
            "target_modules": [p for t in targets for p in PARTS[t]], "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {p: r for t, r in ranks.items() for p in PARTS[t]},
            "alpha_pattern": {p: alpha * r / rank for t, r in ranks.items() for p in PARTS[t]}}


def peft_tensors(adapters: dict, g: hw.Geometry) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors's tensors for our adapters {(layer, target): (A, B)} (TP=1 layout)."""
    out = {}
    for (layer, target), (a, b) in sorted(adapters.items()):
        for hf_name, b_part in hw.to_hf(weight_name(layer, target), b, g).items():
            module = PREFIX + hf_name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = a.clone(memory_format=torch.contiguous_format)
            out[f"{module}.lora_B.weight"] = b_part
    return out


def write_dir(out_dir, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A PEFT adapter directory (written as `<out_dir>.partial`, renamed at the end; `out_dir` absent or empty)."""
    with atomic_directory(out_dir) as partial:
        save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
        (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return Path(out_dir)


# ---- import ------------------------------------------------------------------------------------------------
def read_dir(peft_dir, g: hw.Geometry):
    """`read_adapters` of a PEFT adapter directory."""
    peft_dir = Path(peft_dir)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (peft_dir / name).is_file():
            legacy = name == WEIGHTS_FILE and (peft_dir / "adapter_model.bin").is_file()
            raise PeftAdapterError(f"{peft_dir} has no {name}" + (" (only safetensors adapters import; re-save it "
                                   "with safe_serialization=True)" if legacy else ""), "--lora",
                                   "pass a PEFT adapter directory (PeftModel.save_pretrained)")
    config = json.loads((peft_dir / CONFIG_FILE).read_text())
    return read_adapters(config, load_file(str(peft_dir / WEIGHTS_FILE)), g, str(peft_dir))


def check_config(config: dict, where: str) -> None:
    """Refuse, in one line naming the file and the key, a LoraConfig we cannot represent."""
    if config.get("peft_type") != "LORA":
        raise PeftAdapterError(f"peft_type is {config.get('peft_type')!r}, only LORA adapters import", where)
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise PeftAdapterError(f"task_type is {config['task_type']!r}; only CAUSAL_LM adapters import", where)
    for key, off in _REFUSED.items():
        if config.get(key) not in (off, None, False, [], {}):
            raise PeftAdapterError(f"{key}={config[key]!r} cannot be represented by our LoRA (W + alpha/r B A "
                                   f"on the projections only; expected {off!r})", where)
    targets = config.get("target_modules")  # a string is a regex or "all-linear": the tensors then decide
    unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGET_OF] if isinstance(targets, list) else []
    if unknown:
        raise PeftAdapterError(f"target_modules {unknown} are not LoRA targets of ours (supported: "
                               f"{', '.join(TARGET_OF)})", where)


def _pattern(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern rule: the first key that matches the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def read_adapters(config: dict, tensors: dict[str, torch.Tensor], g: hw.Geometry, where: str):
    """(settings, adapters): our "lora" settings {rank, alpha, dropout, target_modules[, module_ranks]} and
    adapters {(layer, target): (A, B)} (TP=1 layout, float32) for a PEFT adapter. `where`: the directory."""
    check_config(config, f"{where}/{CONFIG_FILE}")
    weights = f"{where}/{WEIGHTS_FILE}"
    rank, rslora = int(config["r"]), bool(config.get("use_rslora"))
    default_scale = float(config["lora_alpha"]) / (math.sqrt(rank) if rslora else rank)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        part = match.group(3) if match else None
        known = part in TARGET_OF and match.group(2) == _PARENT[TARGET_OF[part]][1]
        if not known or int(match.group(1)) >= g.num_layers:
            raise PeftAdapterError(f"tensor {key} is not a lora_A/lora_B of a projection our LoRA adapts (q/k/v/o/"
                                   f"gate/up/down_proj of layers 0-{g.num_layers - 1})", weights)
        found.setdefault((int(match.group(1)), part), {})[match.group(4)] = tensor
    modules = {}
    for (layer, part), ab in sorted(found.items()):
        name = module_name(layer, part)
        if set(ab) != {"A", "B"}:
            raise PeftAdapterError(f"{PREFIX}{name} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}",
                                   weights)
        out, fan_in = part_shape(part, g)
        r = int(_pattern(config.get("rank_pattern"), name, rank))
        if ab["A"].shape != (r, fan_in) or ab["B"].shape != (out, r):
            raise PeftAdapterError(f"{PREFIX}{name}: lora_A {list(ab['A'].shape)}, lora_B {list(ab['B'].shape)}; "
                                   f"this base and rank {r} need [{r}, {fan_in}] and [{out}, {r}] (an adapter of "
                                   f"another model, or a rank_pattern that does not match its tensors)", weights)
        alpha = float(_pattern(config.get("alpha_pattern"), name, config["lora_alpha"]))
        ratio = alpha / (math.sqrt(r) if rslora else r) / default_scale
        b = ab["B"].float()
        modules[(layer, part)] = (ab["A"].float(), b if ratio == 1.0 else b * ratio)
    adapters = {}
    for target, parts in PARTS.items():
        for layer in range(g.num_layers):
            if any((layer, p) in modules for p in parts):
                adapters[(layer, target)] = _fuse(layer, target, {p: modules.get((layer, p)) for p in parts}, g)
    ranks = {}
    for (layer, target), (a, _) in adapters.items():
        ranks[target] = max(ranks.get(target, 0), a.shape[0])
    adapters = {key: _pad(a, b, ranks[key[1]]) for key, (a, b) in adapters.items()}
    targets = [t for t in TARGETS if t in ranks]
    if not targets:
        raise PeftAdapterError("no lora_A/lora_B tensors of q/k/v/o/gate/up/down_proj", weights)
    alpha = float(config["lora_alpha"]) * (math.sqrt(rank) if rslora else 1.0)  # alpha / rank = the default scale
    settings = {"rank": rank, "alpha": alpha, "dropout": float(config.get("lora_dropout") or 0.0),
                "target_modules": targets}
    if any(r != rank for r in ranks.values()):
        settings["module_ranks"] = {t: r for t, r in ranks.items() if r != rank}
    return settings, adapters


def _fuse(layer: int, target: str, parts: dict, g: hw.Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused (A, B) for a layer's parts {part: (A, B) or None}: a shared A when every present part has the
    same one, else the parts' A's stacked and B block-diagonal; absent parts get zero rows."""
    present = [ab for ab in parts.values() if ab is not None]
    shared = all(torch.equal(a, present[0][0]) for a, _ in present)
    a = present[0][0] if shared else torch.cat([a for a, _ in present])
    blocks, column = {}, 0
    for part, ab in parts.items():
        blocks[part] = torch.zeros(part_shape(part, g)[0], a.shape[0])
        if ab is not None:
            width = ab[1].shape[1]
            blocks[part][:, column:column + width] = ab[1]
            column += 0 if shared else width
    b = hw.from_hf(weight_name(layer, target), lambda hf_name: blocks[hf_name.split(".")[-2]], g)
    return a, b


def _pad(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) at rank `rank` >= theirs: zero rows of A, zero columns of B (the same B A)."""
    extra = rank - a.shape[0]
    if extra == 0:
        return a, b
    return torch.cat([a, a.new_zeros(extra, a.shape[1])]), torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1)
