"""Memory per GPU of a Megatron-core Llama-family model: pure functions of the architecture and the layout.

Conventions (what aligner builds: aligner/models/gpt.py, aligner/models/training.py):
* parameters in `params_dtype` (bf16: 2 bytes, fp32: 4); the DDP gradient buffer in fp32
  (`grad_reduce_in_fp32=True`); Adam with fp32 states: bf16 keeps an fp32 master copy + m + v
  (12 bytes/param), fp32 only m + v (8: the parameters are the master copy). With the distributed
  optimizer those optimizer bytes are divided over the data-parallel ranks (ZeRO-1; Rajbhandari et al.
  2020, and Megatron-LM's docs/distrib_optimizer.md: 6 + 12/d bytes per parameter in bf16).
* tensor parallelism shards every weight matrix and the (padded) vocabulary, not the norms; pipeline
  stage 0 holds the embedding, the last stage the output layer and the final norm.
* activations: the method of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", section 4): count the tensors each operation keeps for its backward pass, per
  layer, in units of s*b*h elements (s tokens per context-parallel rank, b micro-batch, h hidden), here for a
  Llama layer (RMSNorm, GQA with g query groups of head dim d, SwiGLU of width F, no dropout):
  - Transformer Engine (GPU): each fused norm+linear keeps its input and the normalised output (2 x 2),
    flash attention keeps Q, K, V and its output (1 + 2gd/h + 1; the output is also the projection's
    input), the MLP keeps the SwiGLU input (2F/h) and the down projection's input (F/h):
    4 + 2 + 2gd/h + 3F/h. Tensor parallelism divides all but the four norm tensors; sequence
    parallelism divides those too (section 4.2.2).
  - the local spec (CPU), counted from the profiler's live CPU allocations at the step's peak
    (tests/plan_memory_worker.py) on aligner's model: each RMSNorm keeps two s*b*h tensors and reads a
    residual sum that stays alive (2 x 2 + 2, whole on every TP rank unless SP); the QKV projection's
    output (1 + 2gd/h: V is a view of it) and the rotated Q and K (1 + gd/h); then megatron's
    DotProductAttention keeps the softmax output (a*s/h) and the context (1), K and V repeated to every
    head when g < a (2 more), while torch's fused attention keeps only its output (1); the MLP keeps the
    SwiGLU input (2F/h), its silu (F/h) and the product that is the down projection's input (F/h).
  - selective recomputation drops the attention core (the s^2 term and, for the local spec, Q/K/V);
    full recomputation keeps only each layer's input (1, divided by TP under SP) plus one layer's
    working set during its backward.
* the step's peak (`activation_bytes`) is not the saved activations alone: it falls in the first
  backward of a micro-batch, when everything saved is still alive and the backward's first gradients
  exist too. On the last stage the larger of
  - the loss's backward: the final norm's two s*b*h tensors and three s*b*V/t tensors (`logits_bytes`:
    the saved log-softmax (or the vocab-parallel softmax), the log-probs' gradient scattered into the
    vocabulary, the log-softmax backward's output; in the parameter dtype for the logits, fp32 for the rest),
    at the positions whose output the loss reads only (aligner.models.read_positions.output_at): an RL
    sequence's response (`logit_tokens`: sampling.max_new_tokens; under CP the most of them one rank's two
    load-balanced chunks hold, `response_rows_per_cp_rank`), not its prompt;
  - the last layer's MLP backward (`layer_backward_elements`): the residual stream's gradient and the
    norm's (2 s*b*h, whole on every TP rank without SP) plus the down projection's input gradient (F),
    the SwiGLU input's gradient (2F) and the backward's gate temporary (F), less the product (F) the down
    projection's backward has just freed: 2 + 3F/(h t);
  on the other stages the MLP backward term. The local spec also keeps megatron's global memory buffer,
  the baddbmm input of a*s^2*b/t elements, allocated on the first forward and never freed; the first stage
  keeps the embedding's output (s*b*h, the first layer's input) per micro-batch in flight. The same
  gradient terms apply to Transformer Engine's layers (their backward produces the same gradients; no s^2
  buffer). The optimizer step is never the peak: torch's fused AdamW on CPU
  (aligner.models.training.use_fused_cpu_adam), like TE's and apex's on GPU, updates in place without
  temporaries, and the activations are freed by then; Adam's states exist from the first step on.
* KV cache for generation: 2 (K and V) x layers of the stage x tokens x batch x g/t query groups x d
  (Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 2).
* LoRA (aligner/models/lora.py; model.lora.rank = r > 0): the base is frozen, so its weights are all it
  costs (no gradient buffer, no Adam state), and the reference of DPO/KTO/SPIN/GRPO/PPO is the same weights
  with the adapters off (no copy). An adapted linear of global input width `in` and output width `out`
  gets A (r x in) and B (out x r): r (in + out) parameters, which train (fp32 gradient buffer and Adam
  like any trained parameter). Under TP a column-parallel base (linear_qkv, linear_fc1) keeps A whole and
  splits B (r in + r out/t a GPU), a row-parallel one (linear_proj, linear_fc2) splits A and keeps B whole
  (r in/t + r out). Activations are those of full training: the input gradients still flow through every
  layer, so each keeps what its backward needs (a frozen linear no longer saves its input, but the adapter's
  A, which reads the same tensor, does), plus per adapted linear the r-wide A x (s*b*r, whole on every TP
  rank but split along the sequence after a row-parallel base under SP) and, with dropout, the dropped copy
  of the input that A saves and its one-byte mask. This errs high, on the safe side: measured on CPU
  (tests/integration/test_plan_memory.py), a LoRA step's peak is 4-7% under it, since a frozen RMSNorm
  weight needs no saved normalised input, nor a frozen output layer its input, and with dropout the base's
  inputs that only the linears saved are freed. Generation by the lean decoder (the in-process engine's
  default) computes with merged weights W + scale B A, made once per generate call for every adapted
  linear of the stage: a second copy of those matrices while it decodes, plus the merge's fp32 temporaries
  of the largest one (W in fp32, B A, their sum: 12 bytes an element in bf16; in fp32 W is itself and the sum
  is the copy kept, 4 more).
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
BRIDGE_BUCKET_BYTES = 1 << 30  # aligner/models/weight_stream.py's DEFAULT_BUCKET_BYTES (the planner imports no torch)
LORA_COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # the other targets (linear_proj, linear_fc2) are row-parallel


@dataclass(frozen=True)
class Shape:
    """A Llama-family decoder as the memory and FLOP formulas see it (the padded vocabulary included)."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int  # padded: a multiple of make_vocab_size_divisible_by x TP
    tied: bool = False
    qkv_bias: bool = False

    @classmethod
    def of(cls, m, vocab_size: int) -> "Shape":
        """From a ModelConfig (aligner/config/schema.py) and the unpadded vocabulary size."""
        multiple = m.make_vocab_size_divisible_by * m.tensor_model_parallel_size
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups or m.num_attention_heads,
                   m.kv_channels or m.hidden_size // m.num_attention_heads, m.ffn_hidden_size,
                   -(-vocab_size // multiple) * multiple, m.tie_embeddings, m.add_qkv_bias)

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.groups) * self.head_dim


def layer_parameters(s: Shape) -> int:
    """One decoder layer: QKV (h x (a + 2g)d, + bias), output projection (ad x h), SwiGLU (h x 2F and
    F x h), two RMSNorm weights (h each)."""
    qkv = s.hidden * s.qkv_width + (s.qkv_width if s.qkv_bias else 0)
    return qkv + s.heads * s.head_dim * s.hidden + 3 * s.hidden * s.ffn + 2 * s.hidden


def parameter_count(s: Shape) -> int:
    """The whole model: layers, embedding, output layer (unless tied) and the final norm."""
    return s.layers * layer_parameters(s) + s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden


def parameters_per_gpu(s: Shape, tp: int, pp: int) -> int:
    """Parameters on the busiest GPU: the larger of the first stage (layers + embedding shard) and
    the last (layers + output shard + final norm); norms are replicated over TP."""
    norms = 2 * s.hidden
    layers = s.layers // pp * ((layer_parameters(s) - norms) // tp + norms)
    vocab_shard = s.vocab * s.hidden // tp
    if pp == 1:
        return layers + vocab_shard * (1 if s.tied else 2) + s.hidden
    return layers + vocab_shard + s.hidden  # stage 0: embedding; last stage: output layer + final norm


def weight_bytes(params: int, dtype: str) -> int:
    return params * DTYPE_BYTES[dtype]


def gradient_bytes(params: int) -> int:
    """The DDP gradient buffer: fp32 in both precisions (grad_reduce_in_fp32)."""
    return params * 4


def optimizer_bytes(params: int, dtype: str, dp: int, distributed: bool) -> float:
    """Adam: fp32 m and v, plus an fp32 master copy under bf16; sharded over DP with the distributed optimizer."""
    per_param = 12 if dtype == "bfloat16" else 8
    return params * per_param / (dp if distributed else 1)


def layer_activation_elements(s: Shape, tokens: int, batch: int, tp: int, sp: bool, impl: str,
                              recompute: str = "none") -> float:
    """Elements one layer keeps for its backward pass (see the module doc). tokens: per CP rank;
    impl: "te" (flash attention), "local" (megatron's DotProductAttention) or "local_sdpa" (torch's fused
    attention); recompute: none | selective | full."""
    h, sbh = s.hidden, tokens * batch * s.hidden
    kv = s.groups * s.head_dim / h
    if recompute == "full":
        return sbh / (tp if sp else 1)
    if impl == "te":
        norms = 4 / (tp if sp else 1)
        core = 2 + 2 * kv
        rest = 3 * s.ffn / h
        return sbh * (norms + (core + rest) / tp)  # flash attention keeps no s^2 term: selective = none
    stream = (4 + 2) / (tp if sp else 1)  # the two norms' tensors and the residual sums they read
    mlp = 4 * s.ffn / h
    if recompute == "selective":
        core = 1  # the projection's input
    else:
        core = (1 + 2 * kv) + (1 + kv)  # the QKV projection's output, the rotated Q and K
        if impl == "local":
            core += s.heads * tokens / h + 1 + (2 if s.groups < s.heads else 0)  # softmax (a s^2 b), context
        else:
            core += 1  # torch's fused attention: its output
    return sbh * (stream + (core + mlp) / tp)


def layer_backward_elements(s: Shape, tokens: int, batch: int, tp: int, sp: bool) -> float:
    """The gradients alive at the peak of a layer's backward (its MLP, the first part the backward
    reaches) over what the layer saved: 2 s*b*h (the residual stream's and the norm's) + 3F s*b/t."""
    return tokens * batch * (2 * s.hidden / (tp if sp else 1) + 3 * s.ffn / tp)


def logits_bytes(s: Shape, tokens: int, batch: int, tp: int, dtype: str) -> float:
    """The loss's backward on the last stage: the logits in the parameter dtype (saved by the log-softmax
    in fp32 runs, where the two coincide) and two fp32 gradient-sized tensors (the module doc)."""
    return tokens * batch * s.vocab / tp * (DTYPE_BYTES[dtype] + 8)


def activation_bytes(s: Shape, tokens: int, micro_batch: int, micro_batches: int, tp: int, pp: int, cp: int,
                     sp: bool, dtype: str, impl: str, recompute: str = "none",
                     logit_tokens: int | None = None, lora: Lora | None = None) -> float:
    """The step's peak of activation memory on the busiest pipeline stage under 1F1B: what the
    micro-batches in flight saved plus the first backward's gradients (the module doc).
    tokens: sequence length (split over CP); micro_batches: per optimizer step on this DP rank;
    logit_tokens: the positions of a sequence whose logits the loss reads (None: all);
    lora: a LoRA run's adapters (their own activations on top of the base's, which are unchanged)."""
    per_rank = tokens // cp
    logit_rows = per_rank if logit_tokens is None else min(logit_tokens, per_rank)
    element = DTYPE_BYTES[dtype]
    adapters = 0.0 if lora is None else adapter_activation_bytes(s, lora, per_rank, micro_batch, tp, sp, dtype)
    per_layer = layer_activation_elements(s, per_rank, micro_batch, tp, sp, impl, recompute) * element
    stage_layers = s.layers // pp
    sbh = per_rank * micro_batch * s.hidden / (tp if sp else 1)
    backward = layer_backward_elements(s, per_rank, micro_batch, tp, sp) * element
    if recompute == "full":  # one layer's full working set while it is recomputed
        backward += layer_activation_elements(s, per_rank, micro_batch, tp, sp, impl, "none") * element + adapters
    else:
        per_layer += adapters
    loss = 2 * sbh * element + logits_bytes(s, logit_rows, micro_batch, tp, dtype)
    buffer = s.heads / tp * per_rank ** 2 * micro_batch * element if impl == "local" else 0.0

    def stage(in_flight: int, first: bool, last: bool) -> float:
        saved = in_flight * (stage_layers * per_layer + (sbh * element if first else 0))
        return saved + buffer + max(backward, loss if last else 0.0)

    if pp == 1:
        return stage(1, True, True)
    return max(stage(min(pp, micro_batches), True, False), stage(1, False, True))


def response_rows_per_cp_rank(tokens: int, response: int, cp: int) -> int:
    """The most response positions (those whose logits an RL loss reads) one CP rank holds: megatron's
    load-balanced split cuts a sequence of `tokens` into 2 x CP chunks, rank r holding chunks r and 2CP-1-r
    (aligner/models/cp_attention.py); the response is the sequence's last `response` tokens."""
    if cp == 1:
        return min(response, tokens)
    chunk, start = -(-tokens // (2 * cp)), tokens - response  # padded to a multiple of 2 x CP

    def overlap(k: int) -> int:
        return max(0, min((k + 1) * chunk, tokens) - max(k * chunk, start))

    return max(overlap(r) + overlap(2 * cp - 1 - r) for r in range(cp))


def kv_cache_bytes(s: Shape, tokens: int, batch: int, tp: int, pp: int, dtype: str) -> float:
    """K and V of every layer of a stage for `batch` sequences of `tokens` (prompt + response); query groups
    are split over TP (replicated when TP exceeds them)."""
    groups = max(s.groups / tp, 1)
    return 2 * (s.layers // pp) * tokens * batch * groups * s.head_dim * DTYPE_BYTES[dtype]


def bridge_bucket_bytes(s: Shape, dtype: str) -> float:
    """The largest weight-stream bucket a rollout worker receives at once (aligner/models/weight_stream.py:
    buckets of at most 1 GiB, a larger tensor alone; megatron's full shapes: the padded vocabulary, fc1 as
    gate and up together), and never more than the whole model."""
    largest = max(s.vocab, 2 * s.ffn, s.qkv_width) * s.hidden * DTYPE_BYTES[dtype]
    return min(max(BRIDGE_BUCKET_BYTES, largest), weight_bytes(parameter_count(s), dtype))


# ---- LoRA (the module doc) -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lora:
    """The adapters of a LoRA run as the formulas see them."""

    rank: int
    targets: tuple[str, ...]
    dropout: float = 0.0

    @classmethod
    def of(cls, lora_cfg) -> "Lora | None":
        """From a LoraConfig (model.lora, critic.lora); None when absent or rank 0 (full training)."""
        if lora_cfg is None or int(lora_cfg.get("rank") or 0) <= 0:
            return None
        return cls(int(lora_cfg.rank), tuple(lora_cfg.target_modules), float(lora_cfg.get("dropout") or 0.0))


def linear_widths(s: Shape) -> dict[str, tuple[int, int]]:
    """(input, output) width of each linear of a layer, whole (before TP); fc1 is SwiGLU's gate and up."""
    return {"linear_qkv": (s.hidden, s.qkv_width), "linear_proj": (s.heads * s.head_dim, s.hidden),
            "linear_fc1": (s.hidden, 2 * s.ffn), "linear_fc2": (s.ffn, s.hidden)}


def adapter_layer_parameters(s: Shape, lora: Lora, tp: int = 1) -> int:
    """A and B of one layer's adapted linears on one TP rank: r (in + out/t) column-parallel,
    r (in/t + out) row-parallel; tp=1: the layer's whole r (in + out) each."""
    total = 0
    for target in lora.targets:
        fan_in, fan_out = linear_widths(s)[target]
        split_in, split_out = (fan_in, fan_out // tp) if target in LORA_COLUMN_PARALLEL else (fan_in // tp, fan_out)
        total += lora.rank * (split_in + split_out)
    return total


def adapter_parameter_count(s: Shape, lora: Lora) -> int:
    """Every adapter parameter of the model."""
    return s.layers * adapter_layer_parameters(s, lora)


def adapter_parameters_per_gpu(s: Shape, lora: Lora, tp: int, pp: int) -> int:
    """A GPU's: its stage's layers (the same number on every stage), its TP shards."""
    return s.layers // pp * adapter_layer_parameters(s, lora, tp)


def adapter_activation_bytes(s: Shape, lora: Lora, tokens: int, batch: int, tp: int, sp: bool, dtype: str) -> float:
    """What one layer's adapters keep for the backward beyond the base's own activations: the r-wide A x of
    each adapted linear (split along the sequence only after a row-parallel base under SP) and, with
    dropout, the dropped input (A's saved input; split like the base's) and its bool mask."""
    element, total = DTYPE_BYTES[dtype], 0.0
    for target in lora.targets:
        column = target in LORA_COLUMN_PARALLEL
        fan_in = linear_widths(s)[target][0]
        total += tokens * batch * lora.rank / (tp if sp and not column else 1) * element
        if lora.dropout > 0:
            split = (tp if sp else 1) if column else tp  # the column base's input: split along s under SP
            total += tokens * batch * fan_in / split * (element + 1)
    return total


def merged_weight_bytes(s: Shape, lora: Lora, tp: int, pp: int, dtype: str) -> float:
    """The lean decoder's merged weights W + scale B A of the stage's adapted linears (TP shards), kept for a
    generate call, plus the merge's fp32 temporaries of the largest one (the module doc)."""
    local = [fan_in * fan_out / tp for fan_in, fan_out in (linear_widths(s)[t] for t in lora.targets)]
    temporaries = max(local) * (12 if dtype == "bfloat16" else 4)
    return s.layers // pp * sum(local) * DTYPE_BYTES[dtype] + temporaries
