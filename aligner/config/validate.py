"""Cross-field rules. Each message says what is wrong and how to fix it."""
from __future__ import annotations


def _fail(msg: str):
    from aligner.config.load import ConfigError

    raise ConfigError(msg)


def validate_model(m, world_size: int) -> int:
    """Checks the model/parallel layout; returns the data-parallel size."""
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if min(tp, pp, cp) < 1:
        _fail(f"model.tensor/pipeline/context_parallel_size must be >= 1, got TP={tp} PP={pp} CP={cp}")
    if world_size % (tp * pp * cp):
        _fail(f"{world_size} ranks cannot be split into TP={tp} x PP={pp} x CP={cp}: set launcher.nproc_per_node "
              f"(x nodes) to a multiple of {tp * pp * cp}")
    if m.num_attention_heads % tp:
        _fail(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
              f"model.tensor_model_parallel_size={tp}; pick a TP that divides the head count")
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        _fail(f"model.num_attention_heads={m.num_attention_heads} must be a multiple of model.num_query_groups={groups}")
    if groups % tp:
        _fail(f"model.num_query_groups={groups} is not divisible by model.tensor_model_parallel_size={tp}")
    if m.num_layers % pp:
        _fail(f"model.num_layers={m.num_layers} is not divisible by model.pipeline_model_parallel_size={pp}; "
              f"pick a PP that divides the layer count")
    if m.ffn_hidden_size % tp:
        _fail(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by model.tensor_model_parallel_size={tp}")
    if cp > 1 and m.seq_length % (2 * cp):
        _fail(f"model.seq_length={m.seq_length} must be divisible by 2 x context_parallel_size = {2 * cp} "
              f"(each CP rank holds two chunks); round it up to a multiple of {2 * cp}")
    if m.sequence_parallel and tp == 1:
        _fail("model.sequence_parallel=true needs model.tensor_model_parallel_size > 1")
    if m.params_dtype not in ("float32", "bfloat16"):
        _fail(f"model.params_dtype must be float32 or bfloat16, got '{m.params_dtype}'")
    if m.transformer_impl not in ("auto", "local", "transformer_engine"):
        _fail(f"model.transformer_impl must be auto, local or transformer_engine, got '{m.transformer_impl}'")
    return world_size // (tp * pp * cp)


def validate(cfg, world_size: int) -> None:
    dp = validate_model(cfg.model, world_size)
    t = cfg.trainer
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        _fail("trainer.micro_batch_size and trainer.global_batch_size must be >= 1")
    if t.global_batch_size % (t.micro_batch_size * dp):
        _fail(f"trainer.global_batch_size={t.global_batch_size} must be divisible by trainer.micro_batch_size="
              f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}; e.g. set "
              f"trainer.global_batch_size={t.micro_batch_size * dp * max(1, t.global_batch_size // (t.micro_batch_size * dp))}")
    if t.max_steps < 1:
        _fail(f"trainer.max_steps must be >= 1, got {t.max_steps}")
    if cfg.data.overlong not in ("truncate", "drop"):
        _fail(f"data.overlong must be 'truncate' or 'drop', got '{cfg.data.overlong}'")
    if cfg.data.format not in ("auto", "chat", "input_output"):
        _fail(f"data.format must be auto, chat or input_output, got '{cfg.data.format}'")
    if cfg.data.max_length > cfg.model.seq_length:
        _fail(f"data.max_length={cfg.data.max_length} exceeds model.seq_length={cfg.model.seq_length}")
    if cfg.optim.scheduler not in ("cosine", "linear", "constant"):
        _fail(f"optim.scheduler must be cosine, linear or constant, got '{cfg.optim.scheduler}'")
    if cfg.launcher.nproc_per_node < 1:
        _fail("launcher.nproc_per_node must be >= 1")
    if cfg.optim.min_lr > cfg.optim.lr:
        _fail(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}; the schedule decays from lr to "
              f"min_lr, so set min_lr <= lr")
    if "steerlm" in cfg:
        s = cfg.steerlm
        if not s.attributes or len(set(s.attributes)) != len(s.attributes):
            _fail(f"steerlm.attributes must name each attribute once, e.g. [helpfulness,verbosity]; got "
                  f"{list(s.attributes)}")
        if s.scale < 1:
            _fail(f"steerlm.scale must be >= 1 (values are integers in [0, scale]), got {s.scale}")
    if "spin" in cfg:
        if cfg.spin.steps_per_iteration < 1 or cfg.spin.max_new_tokens < 1:
            _fail("spin.steps_per_iteration and spin.max_new_tokens must be >= 1")
        mode = getattr(cfg.reference.mode, "value", cfg.reference.mode)
        if mode == "precompute":
            _fail("reference.mode=precompute does not apply to SPIN: its reference changes every iteration; "
                  "use reference.mode=model or cpu_swap")
        loss = getattr(cfg.dpo.loss_type, "value", cfg.dpo.loss_type)
        if str(loss).startswith("rpo"):
            _fail(f"dpo.loss_type={loss} needs rewards in the data; SPIN's generated pairs have none")
        if cfg.model.context_parallel_size > 1:
            _fail("SPIN generates with the training model, and generation does not run under context "
                  "parallelism: set model.context_parallel_size=1")
    if "rm" in cfg:
        loss = getattr(cfg.rm.loss, "value", cfg.rm.loss)
        if loss == "regression" and not cfg.rm.attributes:
            _fail("rm.loss=regression needs rm.attributes: the names of the labels to regress, e.g. "
                  "rm.attributes=[helpfulness,correctness]")
        if loss != "regression" and cfg.rm.attributes:
            _fail(f"rm.attributes is only used by rm.loss=regression (got rm.loss={loss})")
    if "dpo" in cfg:
        loss, smoothing = getattr(cfg.dpo.loss_type, "value", cfg.dpo.loss_type), cfg.dpo.label_smoothing
        if smoothing and loss not in ("sigmoid", "robust"):
            _fail(f"dpo.label_smoothing applies to dpo.loss_type=sigmoid or robust, not {loss}")
        if not 0 <= smoothing < 0.5:
            _fail(f"dpo.label_smoothing is a label-flip probability in [0, 0.5), got {smoothing}")
    if cfg.data.get("packing") and cfg.model.transformer_impl == "transformer_engine":
        _fail("data.packing=true needs the local layer spec (model.transformer_impl=local or auto on a host "
              "without Transformer Engine)")
