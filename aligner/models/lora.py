"""LoRA: low-rank adapters on megatron's parallel linears, with the base weights frozen.

An adapted linear computes W x + (alpha / r) * B A dropout(x), A: in -> r, B: r -> out. B starts at
zero, so fresh adapters compute exactly what the base computes. Tensor parallelism follows the base:
* column-parallel bases (`linear_qkv`, `linear_fc1`, output rows split over TP): A whole on every rank,
  B split by rows as W is, so the rows of fused QKV's interleaved query groups and of the gated fc1's
  [gate; up] halves line up with W's. The r-wide activation A x enters the TP region as the base's
  input does: copied (its gradient summed over TP) or, under sequence parallelism, all-gathered along
  the sequence (its gradient reduce-scattered).
* row-parallel bases (`linear_proj`, `linear_fc2`, input columns split over TP): A split by columns as
  W is, B whole. The partial products A_t x_t are summed over TP where the base sums its own (all-reduce,
  or reduce-scatter along the sequence under SP); B then applies on every rank.
Under SP a whole adapter matrix that sees only this rank's positions gets a partial gradient: it is
tagged `sequence_parallel`, and megatron's finalize_model_grads sums it over TP as it does the norms'.

The adapter is a child module `lora` of the base linear that runs as a forward hook, so the base keeps
its class, parameter names and checkpoint keys; the adapter's parameters are `<linear>.lora.a` and
`<linear>.lora.b`. `disabled(model)` switches every adapter off: that is the reference model of a LoRA
run, with no second copy of the weights.
"""
from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.nn.functional as F

# megatron is imported inside the functions that build or run adapters: checkpoint.py imports this module,
# and the CLI process imports checkpoint.py before it launches ranks.

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # the others are row-parallel


def enabled(lora_cfg) -> bool:
    return lora_cfg is not None and int(lora_cfg.rank) > 0


class Adapter(torch.nn.Module):
    """The A and B of one base linear (this rank's shards); `forward(x)` is the scaled update."""

    def __init__(self, base, target: str, rank: int, alpha: float, dropout: float, layer_number: int):
        from megatron.core import parallel_state as ps  # deferred (module note)
        from megatron.core import tensor_parallel as tp_maps

        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.tp = tp
        out_local, in_local = base.weight.shape
        self.target, self.column = target, target in COLUMN_PARALLEL
        self.scale, self.dropout, self.active = alpha / rank, dropout, True
        self.sequence_parallel = bool(base.config.sequence_parallel) and tp > 1
        self.norm = _fused_norm(base)
        dtype, device = base.weight.dtype, base.weight.device
        in_full = in_local if self.column else in_local * tp
        a = _init_a(rank, in_full, layer_number, target)  # whole, from a seed: the same at any TP
        if not self.column:
            a = a.chunk(tp, dim=1)[ps.get_tensor_model_parallel_rank()]
        self.a = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        split, whole = (self.b, self.a) if self.column else (self.a, self.b)
        tp_maps.set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        whole.sequence_parallel = self.sequence_parallel  # partial gradient under SP: summed over TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.low_rank(x), self.b) * self.scale

    def added_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + forward(x), the scale and the add done by the product B (A x) itself (one addmm): the
        separate scaling and add each read and wrote a whole [tokens, out] activation, forward and backward.
        Equal to `out + forward(x)` bitwise when the scale is a power of two (alpha 32, rank 16: 2), else
        within a rounding of the scaled product."""
        if self.b.dtype != out.dtype:
            return out + self(x).to(out.dtype)
        a = self.low_rank(x)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), a.reshape(-1, a.shape[-1]), self.b.t(), alpha=self.scale)
        return flat.view(out.shape)

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """A x (normed and dropped out as the base's input is), entering the TP region as the base's input does."""
        from megatron.core import tensor_parallel as tp_maps  # deferred (module note)

        if self.norm is not None:
            x = self.norm(x)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        a = F.linear(x, self.a)
        if self.tp == 1:  # the mappings are identities on one rank: skip their autograd nodes
            return a
        if self.column:
            return (tp_maps.gather_from_sequence_parallel_region(a, tensor_parallel_output_grad=True)
                    if self.sequence_parallel else tp_maps.copy_to_tensor_model_parallel_region(a))
        return (tp_maps.reduce_scatter_to_sequence_parallel_region(a) if self.sequence_parallel
                else tp_maps.reduce_from_tensor_model_parallel_region(a))


def _init_a(rank: int, fan_in: int, layer_number: int, target: str) -> torch.Tensor:
    """A whole: uniform in +-1/sqrt(fan_in) (PEFT's kaiming-uniform, a = sqrt(5)), from a generator seeded
    by the run's seed, the layer's global number and the target, so no rank layout changes it."""
    from aligner.runtime.seeding import run_seed  # deferred: imports megatron (module note)

    key = f"{run_seed()} {layer_number} {target}".encode()
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(rank, fan_in).uniform_(-bound, bound, generator=generator)


def _fused_norm(base):
    """Transformer Engine's LayerNormColumnParallelLinear takes the un-normed input and norms it inside:
    the adapter needs the normed input, computed here with the module's own weight (RMSNorm)."""
    weight = getattr(base, "layer_norm_weight", None)
    if weight is None:
        return None
    eps = base.config.layernorm_epsilon
    return lambda x: F.rms_norm(x, (x.shape[-1],), weight, eps)


def _hook(module, args, output):
    adapter = module.lora
    if not adapter.active:
        return output
    out, bias = output
    return adapter.added_to(out, args[0]), bias


def _sharded_state_dict(module, base_sharded):
    """The base's sharded state dict, its adapter entries replaced by TP-sharded ones (megatron's own
    treats every key it does not know as replicated)."""

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state as ps  # deferred (module note)
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        entries = {k: v for k, v in base_sharded(prefix, sharded_offsets, metadata).items()
                   if not k.startswith(f"{prefix}lora.")}
        adapter = module.lora
        axis = {"lora.b": 0} if adapter.column else {"lora.a": 1}
        mine = make_sharded_tensors_for_checkpoint(
            {"lora.a": adapter.a, "lora.b": adapter.b}, prefix, axis, sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if adapter.target == "linear_fc1" and module.config.gated_linear_unit:
            # each TP rank holds [gate_r; up_r]: its B rows are two shards, as megatron's MLP says of W
            mine[f"{prefix}lora.b"] = apply_swiglu_sharded_factory(
                mine[f"{prefix}lora.b"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        entries.update(mine)
        return entries
    return sharded_state_dict


def base_linears(model):
    """(name, module) of every linear LoRA can adapt in this stage, in module order."""
    for name, module in _inner(model).named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS and hasattr(module, "weight"):
            yield name, module


def add_adapters(model, lora_cfg, train_head: bool = False):
    """Adapt `lora_cfg.target_modules` of `model` (a GPTModel stage, before DDP wraps it) and freeze
    everything else; with `train_head` a scalar head (reward model, critic) trains too. Returns `model`."""
    for p in model.parameters():
        p.requires_grad_(False)
    for module, adapter in new_adapters(model, lora_cfg):
        attach(module, adapter)
    if train_head and getattr(model, "post_process", False):
        for p in model.output_layer.parameters():
            p.requires_grad_(True)
    return model


def new_adapters(model, lora_cfg) -> list[tuple[torch.nn.Module, Adapter]]:
    """(base linear, fresh Adapter) for each target of `lora_cfg` in this stage, not attached.
    `lora_cfg` may carry `module_ranks` {target: rank} (an imported PEFT adapter's fused projections);
    the scale stays alpha / rank."""
    get = lora_cfg.get if isinstance(lora_cfg, dict) else lambda k, d=None: getattr(lora_cfg, k, d)
    targets, rank, ranks = set(get("target_modules")), int(get("rank")), dict(get("module_ranks") or {})
    made = []
    for name, module in base_linears(model):
        target = name.rsplit(".", 1)[-1]
        if target in targets:
            r = int(ranks.get(target, rank))
            made.append((module, Adapter(module, target, r, float(get("alpha")) * r / rank, float(get("dropout")),
                                         _layer_number(model, name))))
    return made


def attach(module, adapter: Adapter | None) -> Adapter | None:
    """Make `adapter` `module`'s (None: no adapter); returns the one it replaces. The hook and the
    checkpoint entries read `module.lora` when they run, so swapping adapters needs no new hook."""
    previous = getattr(module, "lora", None)
    if adapter is None:
        if previous is not None:
            del module.lora
            module._lora_hook.remove()
            del module._lora_hook, module.sharded_state_dict  # the class's method again
        return previous
    if previous is None:
        module._lora_hook = module.register_forward_hook(_hook)
        module.sharded_state_dict = _sharded_state_dict(module, module.sharded_state_dict)
    module.lora = adapter
    return previous


def _layer_number(model, name: str) -> int:
    """The global (1-based) number of the decoder layer holding `name`."""
    parts = name.split(".")
    layer = _inner(model).decoder.layers[int(parts[parts.index("layers") + 1])]
    return int(layer.layer_number)


def _inner(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def adapters(model) -> list[tuple[str, Adapter]]:
    """(name of the adapted linear, its Adapter) in this stage."""
    return [(name, module.lora) for name, module in _inner(model).named_modules()
            if isinstance(getattr(module, "lora", None), Adapter)]


def is_adapter_parameter(name: str) -> bool:
    return ".lora." in f".{name}"


def has_adapters(model) -> bool:
    return bool(adapters(model))


@contextlib.contextmanager
def disabled(model):
    """Every adapter of `model` off: the base model (LoRA's reference)."""
    found = [a for _, a in adapters(model)]
    states = [a.active for a in found]
    for a in found:
        a.active = False
    try:
        yield model
    finally:
        for a, state in zip(found, states):
            a.active = state


def merged_weight(module) -> torch.Tensor:
    """The weight `module` computes with: W + scale * B A when its adapter is on, else W itself."""
    adapter = getattr(module, "lora", None)
    if not isinstance(adapter, Adapter) or not adapter.active:
        return module.weight
    # one addmm, in float32: the scaled product added as it is made (equal to W + (scale * (B @ A)) bitwise for a
    # power-of-two scale, else within a rounding), instead of a scaling and an add over a whole weight-sized delta
    weight = module.weight.float()
    return torch.addmm(weight, adapter.b.float(), adapter.a.float(), alpha=adapter.scale).to(module.weight.dtype)
