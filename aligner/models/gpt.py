"""Build a Megatron-core `GPTModel` (Llama family) from a `ModelConfig`.

Transformer-Engine layer spec when TE imports on a GPU host, else megatron's local spec, with its
MLP's SwiGLU in one autograd function (`swiglu.py`) and norms that take sequence parallelism on any
device; on the local spec, context parallelism uses our portable all-gather attention (`cp_attention.py`).
Which spec, and why, is one log line (`choose_layer_spec`).
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aligner.models import rope
from aligner.runtime.optional import Availability, probe, unavailable

log = logging.getLogger(__name__)

# megatron, and our modules that import it (cp_attention, swiglu), are imported inside the functions:
# the CLI process imports this module (`aligner convert` through hf_weights, `aligner generate`) before
# it launches ranks.

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the embedding to a multiple of `divisible_by * TP` rows."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class SpecChoice:
    transformer_engine: bool
    reason: str
    warn: bool = False  # a GPU host where TE was expected but does not load: the user should know

    def line(self) -> str:
        return f"layer spec: {'transformer_engine' if self.transformer_engine else 'local'} ({self.reason})"


def choose_layer_spec(impl: str, cuda: bool, te: Availability) -> SpecChoice:
    """The layer spec for `model.transformer_impl` on a host with (`cuda`) or without a CUDA device,
    given what `probe("transformer_engine")` found. `transformer_engine` that cannot load is an error;
    `auto` never falls back in silence: a TE that is installed but fails to import on a CUDA host is a
    warning that carries the import error."""
    if impl == "local":
        return SpecChoice(False, "model.transformer_impl=local")
    if impl == "transformer_engine":
        if not te.importable:
            raise unavailable(te)
        return SpecChoice(True, "model.transformer_impl=transformer_engine")
    if not cuda:
        return SpecChoice(False, "no CUDA device")
    if te.importable:
        return SpecChoice(True, "CUDA + TE importable")
    if not te.installed:
        return SpecChoice(False, "transformer_engine not installed")
    return SpecChoice(False, f"transformer_engine is installed but does not import: {te.reason}; fix the TE install, "
                             f"or set model.transformer_impl=local to choose the local spec", warn=True)


@functools.cache
def _layer_spec_choice(impl: str) -> SpecChoice:
    choice = choose_layer_spec(impl, torch.cuda.is_available(), probe("transformer_engine"))
    log.log(logging.WARNING if choice.warn else logging.INFO, choice.line())  # once per process
    return choice


def use_transformer_engine(impl: str) -> bool:
    return _layer_spec_choice(str(impl)).transformer_engine


class SequenceParallelTorchNorm:
    """megatron's torch norm (`WrappedTorchNorm`) for the local spec, also under sequence parallelism.

    `WrappedTorchNorm` refuses `sequence_parallel` because a torch norm does not tag its parameters;
    the norm itself is per position, so a rank holding a slice of the sequence computes it exactly.
    What SP needs is that the norm's weight gradients, partial sums over this rank's positions, are
    summed over TP: megatron's `finalize_model_grads` does that for parameters tagged
    `sequence_parallel`, which is all that apex's and Transformer Engine's norms do differently.
    Nothing here depends on the device."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm  # deferred (module note)

        without_sp = copy.copy(config)
        without_sp.sequence_parallel = False
        norm = WrappedTorchNorm(without_sp, hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def transformer_config(m, **overrides):
    """megatron TransformerConfig for a Llama-family `ModelConfig`."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # deferred (module note)

    dtype = DTYPES[m.params_dtype]
    on_cpu = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        sequence_parallel=m.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Build whole weights on the CPU and split them: initial weights do not depend on TP.
        use_cpu_initialization=on_cpu,
        # Losses are sums over tokens divided by the global token count (see algorithms/shared/trainer.py),
        # so results do not depend on how the batch is split over micro-batches and DP ranks.
        calculate_per_token_loss=True,
        # No fused kernels: CPU has none, and the TE spec fuses what matters on GPU.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    if m.recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    elif m.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(m):
    """The spec of one decoder layer."""
    from megatron.core.models.gpt import gpt_layer_specs  # deferred (module note)

    if use_transformer_engine(m.transformer_impl):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    spec = copy.deepcopy(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm"))
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelTorchNorm
    if m.context_parallel_size > 1:
        from aligner.models.cp_attention import AllGatherContextParallelAttention  # deferred (module note)

        layer.self_attention.submodules.core_attention = AllGatherContextParallelAttention
    return spec


def decoder_spec(m, config):
    """The decoder block's spec: the layer spec, plus on the local spec the final norm, which megatron
    would otherwise pick by what is installed (TE's, else the torch norm that refuses SP)."""
    # deferred (module note)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = layer_spec(m)
    if use_transformer_engine(m.transformer_impl):
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelTorchNorm)


def build_gpt(m, vocab_size: int, pre_process: bool | None = None, post_process: bool | None = None):
    """A GPTModel for this pipeline stage. `vocab_size` is the unpadded size (tokenizer / HF config)."""
    from megatron.core import parallel_state as ps  # deferred (module note)
    from megatron.core.models.gpt.gpt_model import GPTModel  # deferred (module note)

    rope.install_fused_rope()
    config = transformer_config(m)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(m, config),
        vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, m.tensor_model_parallel_size),
        max_sequence_length=m.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=ps.is_pipeline_last_stage() if post_process is None else post_process,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(m.rotary_base) if float(m.rotary_base).is_integer() else m.rotary_base,
        rope_scaling=m.rope_scaling_factor is not None,
        rope_scaling_factor=m.rope_scaling_factor or 8.0,
    )
    model.true_vocab_size = vocab_size  # logits beyond this index are padding
    if not use_transformer_engine(m.transformer_impl):
        from aligner.models.swiglu import use_swiglu_mlp  # deferred (module note)

        use_swiglu_mlp(model)
    if torch.cuda.is_available():
        model.cuda()
    return model


def layer_offset(m) -> int:
    """Global index of this pipeline stage's first decoder layer."""
    from megatron.core import parallel_state as ps  # deferred (module note)

    return ps.get_pipeline_model_parallel_rank() * (m.num_layers // m.pipeline_model_parallel_size)
