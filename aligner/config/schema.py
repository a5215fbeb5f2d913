"""Dataclass schemas of the groups every training run shares (model, data, optim, ...; their rules:
config/validate.py), of SFT, of the reference model and of the servers. OmegaConf enforces field names and
types from these. Each algorithm family's own groups and rules are in its <family>_schema.py.

Defaults here are the built-in tiny CPU example; YAML files under `conf/` override them.
Derived values are interpolations (`${model.seq_length}`), never repeated numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING

from aligner.errors import ConfigError


class ParamsDtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class TransformerImpl(StrEnum):
    auto = "auto"  # Transformer Engine when it imports on a GPU host, else the local spec
    local = "local"
    transformer_engine = "transformer_engine"


class Recompute(StrEnum):
    none = "none"
    selective = "selective"  # each layer's core attention (softmax(QK^T)V) runs again in the backward pass
    full = "full"  # every decoder layer runs again from its saved input (megatron's full, uniform, 1 layer a chunk)


class DataFormat(StrEnum):
    auto = "auto"  # chat when a record has "messages", else input/output
    chat = "chat"
    input_output = "input_output"


class Overlong(StrEnum):
    truncate = "truncate"
    drop = "drop"


class LRScheduler(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron's four linears of a layer


@dataclass
class LoraConfig:
    """Low-rank adapters on the layers' linears, the base weights frozen (aligner/models/lora.py)."""

    rank: int = 0  # 0 = off (full fine-tuning)
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


def validate_lora(lora, key: str) -> None:
    """`model.lora` / `critic.lora`: a rank >= 0 (0 = off), alpha > 0, dropout in [0, 1), known targets."""
    if lora.rank < 0:
        raise ConfigError(f"{key}.rank must be >= 0 (0 = no adapters, full fine-tuning), got {lora.rank}")
    if lora.alpha <= 0:
        raise ConfigError(f"{key}.alpha must be > 0 (the update is scaled by alpha / rank), got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"{key}.dropout must be in [0, 1), got {lora.dropout}")
    unknown = [t for t in lora.target_modules if t not in LORA_TARGETS]
    if unknown or not lora.target_modules:
        raise ConfigError(f"{key}.target_modules={list(lora.target_modules)}: "
                          f"{'unknown ' + ', '.join(map(str, unknown)) if unknown else 'empty'}; valid: "
                          f"{', '.join(LORA_TARGETS)}")


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
    params_dtype: ParamsDtype = ParamsDtype.float32
    transformer_impl: TransformerImpl = TransformerImpl.auto
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    # activation recomputation: keeps only each layer's input (full) for ~1/3 more compute; what lets 405B train
    recompute: Recompute = Recompute.none
    pretrained: Optional[str] = None  # an aligner (megatron) checkpoint dir to start from
    lora: LoraConfig = field(default_factory=LoraConfig)  # how it is trained, not what it is: not in aligner.json's model


@dataclass
class TokenizerConfig:
    path: str = MISSING  # a local Hugging Face tokenizer directory


@dataclass
class DataConfig:
    train_path: str = MISSING
    val_path: Optional[str] = None
    format: DataFormat = DataFormat.auto
    max_length: int = "${model.seq_length}"  # type: ignore[assignment]
    overlong: Overlong = Overlong.truncate
    shuffle: bool = True


@dataclass
class PackableDataConfig(DataConfig):
    # several sequences per row with block-causal attention, a pair's common prefix computed once (the
    # padded results); null = auto: packed on the local layer spec, padded on Transformer Engine's
    packing: Optional[bool] = False
    pack_length: Optional[int] = None  # most positions in a packed row; None = the step's longest sequence or pair


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
    scheduler: LRScheduler = LRScheduler.cosine
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


class WandbMode(StrEnum):
    online = "online"
    offline = "offline"  # written under <dir>/wandb/offline-run-*; upload later with `wandb sync`


@dataclass
class WandbConfig:
    """Weights & Biases (`pip install 'aligner[wandb]'`); off while `project` is null."""

    project: Optional[str] = None
    entity: Optional[str] = None  # None = the logged-in user's default entity
    name: Optional[str] = None  # None = the run directory's name
    mode: Optional[WandbMode] = None  # None = $WANDB_MODE, else online
    dir: Optional[str] = None  # where W&B keeps its files (<dir>/wandb/); None = the run directory


@dataclass
class MlflowConfig:
    """MLflow (`pip install 'aligner[mlflow]'`); off while `tracking_uri` is null."""

    # http(s)://host:port, sqlite:///mlflow.db, or file:/path (recent MLflow also wants MLFLOW_ALLOW_FILE_STORE=true)
    tracking_uri: Optional[str] = None
    experiment: Optional[str] = None  # None = the name of the run directory's parent
    run_name: Optional[str] = None  # None = the run directory's name


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress: bool = True
    # Experiment trackers get the same keys and steps as metrics.jsonl, from the logging rank only.
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class TrainRunConfig:
    """What every training command has; each command adds its own group (and may narrow `data`)."""

    run_dir: str = "runs/train"
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass
class SFTRunConfig(TrainRunConfig):
    run_dir: str = "runs/sft"
    data: PackableDataConfig = field(default_factory=PackableDataConfig)


# ---- the reference model of preference optimisation and online RL (aligner/algorithms/shared/reference.py) ---
class ReferenceMode(StrEnum):
    model = "model"  # a second frozen model with the policy's layout
    cpu_swap = "cpu_swap"  # reference weights in CPU memory, copied into the policy for its forward
    precompute = "precompute"  # log-probs computed once before training, cached in <run_dir>/reference


@dataclass
class ReferenceConfig:
    # null = `model`, or for a LoRA run (model.lora.rank > 0) its base: the policy with its adapters off
    mode: Optional[ReferenceMode] = None


# ---- servers (`aligner serve`; their rules: aligner/servers/config.py) ----------------------------------------------
@dataclass
class ServerConfig:
    """How a PyTriton server (aligner/servers) listens and batches."""

    host: str = "127.0.0.1"  # bind address of HTTP, gRPC and metrics; 0.0.0.0 accepts other hosts
    port: int = 5555  # HTTP
    grpc_port: Optional[int] = None  # None = port + 1
    metrics_port: Optional[int] = None  # None = port + 2
    max_batch_size: int = 64  # rows per request and per merged model call; more is refused
    max_queue_delay_us: int = 2000  # dynamic batcher: how long a request may wait to be merged
    max_seq_length: Optional[int] = None  # longest accepted request (tokens); None = the model's seq_length
    forward_micro_batch_size: int = 8  # rows per forward pass on each data-parallel rank
    # how long tritonserver waits for in-flight requests and model unloads when stopping (its own default: 30);
    # at 3 a loaded machine's stub could miss it and outlive tritonserver (a model unloads in ~2 s under load)
    exit_timeout_s: int = 10
    log_file: Optional[str] = None  # tritonserver's own log; None = <run_dir>/tritonserver.log
    ready_file: Optional[str] = None  # JSON {pid, url, models} written once every model is served


@dataclass
class ServeParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1  # data-parallel size = launcher.nproc_per_node / (TP x PP)
    params_dtype: Optional[ParamsDtype] = None  # None = the checkpoint's


@dataclass
class RewardOutputConfig:
    """What a served reward is made of."""

    attribute_weights: Optional[list[float]] = None  # regression RMs: serve sum_a w_a r_a as one reward
    standardize: bool = False  # serve (r - mean) / std
    mean: float = 0.0
    std: float = 1.0


@dataclass
class RewardServeConfig:
    checkpoint: str = MISSING  # a reward-model checkpoint (`aligner train rm`, or an imported HF RM)
    tokenizer: Optional[str] = None  # for text (`sentences`) requests; None = <checkpoint>/tokenizer
    run_dir: str = "runs/serve_reward"
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ServeParallelConfig = field(default_factory=ServeParallelConfig)
    reward: RewardOutputConfig = field(default_factory=RewardOutputConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


@dataclass
class CriticTrainConfig:
    global_batch_size: int = 16  # rows per optimizer step; a critic_train request is cut into such steps
    micro_batch_size: int = 4
    epochs: int = 1  # passes over each critic_train request
    max_steps: int = 10000  # length of the LR schedule
    loss_clip: float = 0.2  # value clipping: new values are kept within prev_values +- loss_clip
    seed: int = 1234


@dataclass
class CriticServeConfig:
    checkpoint: Optional[str] = None  # initial weights: a reward/value/LM checkpoint; a critic checkpoint
    # in <run_dir>/checkpoints (from critic_save) takes precedence
    resume_step: Optional[int] = None  # start from the critic checkpoint saved at this actor step (it must
    # exist); None = the latest one, else `checkpoint`
    tokenizer: Optional[str] = None  # for text requests; None = <checkpoint>/tokenizer
    run_dir: str = "runs/serve_critic"
    reward_checkpoint: Optional[str] = None  # co-host this reward model (same architecture), swapped in from CPU
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters on the critic; its checkpoint is the frozen base
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=5567))
    parallel: ServeParallelConfig = field(default_factory=ServeParallelConfig)
    trainer: CriticTrainConfig = field(default_factory=CriticTrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardOutputConfig = field(default_factory=RewardOutputConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


@dataclass
class VerifierServeConfig:
    verifier: str = "arithmetic"  # a rule of aligner.rewards.VERIFIERS
    tokenizer: Optional[str] = None  # to decode token-id requests; text requests need none
    run_dir: str = "runs/serve_verifier"
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=5570))
