"""Which checkpoint keys each layer spec writes, and the only mismatches a load lets through.

The two specs name the same tensors alike in a checkpoint. Transformer Engine fuses each layer's two
pre-norms into the linear that follows (`TELayerNormColumnParallelLinear`: `linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`); megatron's local spec keeps `input_layernorm` / `pre_mlp_layernorm`
modules but saves them under the fused names (its `sharded_state_dict_keys_map`). Each layer's stack
is one key (`decoder.layers.<suffix>`, the layer index is an offset inside it).

What differs is `_extra_state`: TE modules keep FP8 metadata there (scales, amax history; an empty
tensor without FP8). Both specs' linears have one (megatron's local linears save None), but only TE has:
* `decoder.final_layernorm._extra_state`: the final norm is TE's `RMSNorm` on the TE spec. The local
  spec uses a torch norm on every host (models/gpt.py), so its checkpoints never have this key.
* `self_attention.core_attention._extra_state`: in TE's module state dict, never in its checkpoints
  (megatron's `TEDotProductAttention.sharded_state_dict` writes nothing without a learnable softmax).
So a TE model asks a local checkpoint (every `aligner convert hf-to-mcore` output made without TE) for
extra state it lacks: allowed, for TE modules' `_extra_state` only. A local model finds TE extra state
it has no module for: ignored, and said. Anything else that is absent or left over is an error.
"""
from __future__ import annotations

import re

from aligner.errors import UserError

EXTRA_STATE = "_extra_state"
# local-spec module name suffix -> the TE module that holds the same tensor (TE fuses the norm into it)
FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
# state-dict entries a TE-spec model has and a local-spec one does not
TE_LAYER_EXTRA_STATE = ("self_attention.core_attention._extra_state",)
TE_FINAL_NORM_EXTRA_STATE = "decoder.final_layernorm._extra_state"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class CheckpointMismatch(UserError, ValueError):
    """A checkpoint whose tensors do not fit the model being loaded."""


def te_state_dict_name(local_name: str) -> str:
    """A local-spec model's state-dict name -> the name of the same tensor in a TE-spec model."""
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    index, suffix = match.groups()
    for local, te in FUSED_NORMS.items():
        if suffix.startswith(local):
            suffix = te + suffix[len(local):]
    return f"decoder.layers.{index}.{suffix}"


def checkpoint_key(te_name: str) -> str:
    """A TE-spec state-dict name -> its checkpoint key (the layers' stack is one key)."""
    match = _LAYER.match(te_name)
    return te_name if match is None else f"decoder.layers.{match.group(2)}"


def te_checkpoint_keys(local_keys: set[str], final_norm: bool) -> set[str]:
    """The checkpoint keys a TE-spec model requests, from a local-spec model's of the same stage
    (`final_norm`: the stage holds the final norm, i.e. the last pipeline stage)."""
    return set(local_keys) | ({TE_FINAL_NORM_EXTRA_STATE} if final_norm else set())


def te_extra_state_names(model) -> set[str]:
    """State-dict names of the `_extra_state` entries of `model`'s Transformer Engine modules (FP8
    metadata); empty on a model without TE."""
    return {f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE for name, module in model.named_modules()
            if any(c.__module__.split(".")[0] == "transformer_engine" for c in type(module).__mro__)}


def check_checkpoint_keys(absent: set[str], left_over: set[str], te_extra_state: set[str],
                          where: str) -> tuple[set[str], set[str]]:
    """The rule for one load. `absent`: keys the model requests that the checkpoint lacks;
    `left_over`: the checkpoint's keys no rank requested; `te_extra_state`: the model's keys that are
    TE modules' extra state. Returns (absent extra state, ignored extra state), both tolerated;
    raises CheckpointMismatch for anything else."""
    missing = sorted(set(absent) - set(te_extra_state))
    if missing:
        raise CheckpointMismatch(f"the checkpoint lacks {len(missing)} tensor(s) this model needs ({_few(missing)})",
                                 where, "load a checkpoint of this model's architecture (and head)")
    unexpected = sorted(k for k in left_over if not k.endswith("." + EXTRA_STATE))
    if unexpected:
        raise CheckpointMismatch(f"the checkpoint holds {len(unexpected)} tensor(s) this model does not have "
                                 f"({_few(unexpected)})", where, "load a checkpoint of this model's architecture")
    return set(absent), set(left_over)


def check_module_keys(missing: list[str], unexpected: list[str], te_extra_state: set[str], where: str) -> None:
    """After the checkpoint's tensors went into the module (`load_state_dict(strict=False)`'s lists):
    only TE modules' extra state may be missing (TE keeps some outside its checkpoints)."""
    missing = sorted(set(missing) - set(te_extra_state))
    if missing or unexpected:
        raise CheckpointMismatch(f"the loaded state does not fit the model: missing {_few(missing)}, unexpected "
                                 f"{_few(sorted(unexpected))}", where, "load a checkpoint of this model's architecture")


def _few(keys: list[str], n: int = 4) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "") if keys else "none"
