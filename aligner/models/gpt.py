"""Build a Megatron-core `GPTModel` (Llama family) from a `ModelConfig`.

Transformer-Engine layer spec when TE imports on a GPU host, else megatron's local spec, with its
MLP's SwiGLU in one autograd function (`swiglu.py`); on the local spec, context parallelism uses
our portable all-gather attention (`cp_attention.py`).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from aligner.models import rope
from aligner.runtime.optional import probe, require

# megatron, and our modules that import it (cp_attention, swiglu), are imported inside the functions:
# the CLI process imports this module (`aligner convert` through hf_weights, `aligner generate`) before
# it launches ranks.

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the embedding to a multiple of `divisible_by * TP` rows."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def use_transformer_engine(impl: str) -> bool:
    if impl == "local":
        return False
    if impl == "transformer_engine":
        require("transformer_engine")
        return True
    return torch.cuda.is_available() and probe("transformer_engine").importable


def transformer_config(m, **overrides):
    """megatron TransformerConfig for a Llama-family `ModelConfig`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

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
        # Losses are sums over tokens divided by the global token count (see algorithms/trainer.py),
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
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine(m.transformer_impl):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if m.context_parallel_size > 1:
        from aligner.models.cp_attention import AllGatherContextParallelAttention

        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = AllGatherContextParallelAttention
    return spec


def build_gpt(m, vocab_size: int, pre_process: bool | None = None, post_process: bool | None = None):
    """A GPTModel for this pipeline stage. `vocab_size` is the unpadded size (tokenizer / HF config)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    rope.install_fused_rope()
    config = transformer_config(m)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(m),
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
        from aligner.models.swiglu import use_swiglu_mlp

        use_swiglu_mlp(model)
    if torch.cuda.is_available():
        model.cuda()
    return model


def layer_offset(m) -> int:
    """Global index of this pipeline stage's first decoder layer."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank() * (m.num_layers // m.pipeline_model_parallel_size)
