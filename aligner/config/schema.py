"""Dataclass schemas for every config group. OmegaConf enforces field names and types from these.

Defaults here are the built-in tiny CPU example; YAML files under `conf/` override them.
Derived values are interpolations (`${model.seq_length}`), never repeated numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A Llama-family decoder (RMSNorm, SwiGLU, RoPE, GQA), plus how it is parallelised."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # GQA key/value heads; None = one per attention head
    ffn_hidden_size: int = 512
    kv_channels: Optional[int] = None  # head dim; None = hidden_size // num_attention_heads
    vocab_size: Optional[int] = None  # None = the tokenizer's size
    make_vocab_size_divisible_by: int = 128  # padded vocab = multiple of this x TP
    seq_length: int = 256  # longest training sequence (tokens)
    max_position_embeddings: int = "${.seq_length}"  # type: ignore[assignment]
    rotary_base: float = 10000.0
    rope_scaling_factor: Optional[float] = None  # Llama-3.1 long-context frequency scaling
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    add_qkv_bias: bool = False  # Qwen2
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    params_dtype: str = "float32"  # float32 | bfloat16
    transformer_impl: str = "auto"  # auto (TE when importable on GPU) | local | transformer_engine
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    pretrained: Optional[str] = None  # an aligner (megatron) checkpoint dir to start from


@dataclass
class TokenizerConfig:
    path: str = MISSING  # a local Hugging Face tokenizer directory


@dataclass
class DataConfig:
    train_path: str = MISSING
    val_path: Optional[str] = None
    format: str = "auto"  # auto | chat | input_output
    max_length: int = "${model.seq_length}"  # type: ignore[assignment]
    overlong: str = "truncate"  # truncate | drop
    shuffle: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 10
    scheduler: str = "cosine"  # cosine | linear | constant
    decay_steps: int = "${trainer.max_steps}"  # type: ignore[assignment]
    distributed_optimizer: bool = False


@dataclass
class TrainerConfig:
    max_steps: int = 50
    micro_batch_size: int = 4
    global_batch_size: int = 16
    log_interval: int = 1
    val_interval: int = 0  # steps between validations; 0 = never
    val_batches: int = 4  # global batches per validation
    save_interval: int = 0  # steps between checkpoints; 0 = only at the end
    save_last: bool = True
    seed: int = 1234


@dataclass
class LauncherConfig:
    nproc_per_node: int = 1  # ranks this launcher starts on this machine
    master_port: Optional[int] = None  # None = a free port
    threads_per_rank: int = 1  # OMP/torch threads per CPU rank


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress: bool = True


@dataclass
class SFTRunConfig:
    run_dir: str = "runs/sft"
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# command name -> (yaml under conf/, schema)
COMMANDS = {"sft": ("sft", SFTRunConfig)}
