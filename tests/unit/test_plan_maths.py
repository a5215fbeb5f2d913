"""`aligner plan`'s formulas: memory against hand-computed cases, the time model against published figures
(one set of constants, aligner/plan/timing.py). The command from outside: tests/e2e/test_plan.py."""
import pytest

from aligner.plan import memory as M
from aligner.plan import timing as T
from aligner.plan.cli import compose, plan
from aligner.plan.hardware import ACCELERATORS

H100 = ACCELERATORS["h100-80gb"]


def shape(model: str, tp: int = 1, **overrides) -> M.Shape:
    cfg = compose("sft", [f"model={model}", f"model.tensor_model_parallel_size={tp}",
                          *(f"model.{k}={v}" for k, v in overrides.items())])
    return M.Shape.of(cfg.model, cfg.model.vocab_size)


# ---- memory formulas, by hand ------------------------------------------------------------------------------
def test_llama3_8b_has_8_030_261_248_parameters():
    # per layer: QKV 4096 x (4096 + 2 x 1024) + out 4096^2 + SwiGLU 3 x 4096 x 14336 + 2 norms x 4096
    layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert layer == 218_112_000
    # 32 layers + embedding and output (128256 x 4096 each, a multiple of 128: no padding) + final norm
    assert M.parameter_count(shape("llama3_8b")) == 32 * layer + 2 * 128256 * 4096 + 4096 == 8_030_261_248


def test_llama3_70b_tp8_pp4_parameter_bytes_per_gpu():
    s = shape("llama3_70b", tp=8)
    assert s.vocab == 129024  # 128256 padded to a multiple of 128 x TP 8 = 1024
    matrices = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672  # one layer, without its 2 norms
    per_gpu = 20 * (matrices // 8 + 2 * 8192) + 129024 * 8192 // 8 + 8192  # 80/4 layers; output shard + final norm
    assert per_gpu == 2_271_551_488
    assert M.parameters_per_gpu(s, 8, 4) == per_gpu
    assert M.weight_bytes(per_gpu, "bfloat16") == 4_543_102_976  # 4.23 GiB
    assert M.gradient_bytes(per_gpu) == 4 * per_gpu  # fp32 buffer
    assert M.optimizer_bytes(per_gpu, "bfloat16", dp=2, distributed=False) == 12 * per_gpu
    assert M.optimizer_bytes(per_gpu, "bfloat16", dp=2, distributed=True) == 6 * per_gpu
    assert M.optimizer_bytes(per_gpu, "float32", dp=4, distributed=True) == 2 * per_gpu


def test_activations_of_a_llama_70b_layer_by_hand():
    s = shape("llama3_70b", tp=8)
    sbh = 4096 * 1 * 8192
    # TE, TP 8 with SP: 4 norm tensors / 8 + (Q + O + K,V at 2 x 1024/8192 + SwiGLU 3 x 28672/8192) / 8
    assert M.layer_activation_elements(s, 4096, 1, 8, True, "te") == sbh * (0.5 + (2 + 0.25 + 10.5) / 8)
    # without SP the four norm tensors stay whole on every TP rank (Korthikanti et al. 2022, section 4.2.2)
    assert M.layer_activation_elements(s, 4096, 1, 8, False, "te") == sbh * (4 + 12.75 / 8)
    assert M.layer_activation_elements(s, 4096, 1, 8, True, "te", "full") == sbh / 8
    # local spec: 12 s*b*h (2 norms x 2, the 2 residual sums, QKV output 3, rotated Q and K 2, context 1)
    # + 4F (SwiGLU input 2F, silu F, product F) + a*s^2*b (the softmax output)
    tiny = M.Shape(4, 128, 4, 4, 32, 512, 512)
    assert M.layer_activation_elements(tiny, 256, 32, 1, False, "local") == 256 * 32 * (12 * 128 + 4 * 512 + 4 * 256)
    # torch's fused attention keeps its output (1) instead of the softmax and the context: 12 s*b*h + 4F
    assert M.layer_activation_elements(tiny, 256, 32, 1, False, "local_sdpa") == 256 * 32 * (12 * 128 + 4 * 512)


def test_step_peak_of_the_tiny_model_by_hand():
    tiny = M.Shape(4, 128, 4, 4, 32, 512, 512)
    sb = 256 * 32
    layers = 4 * sb * (12 * 128 + 4 * 512 + 4 * 256)
    embedding = sb * 128  # the first layer's input
    buffer = 4 * 256 * 256 * 32  # megatron's baddbmm buffer, a*s^2*b
    mlp_backward = sb * (2 * 128 + 3 * 512)  # residual and norm gradients + F + 2F + F - the freed F
    loss_backward = sb * 2 * 128 + sb * 512 * 3  # the final norm + 3 x s*b*V
    peak = 4 * (layers + embedding + buffer + max(mlp_backward, loss_backward))  # fp32
    assert M.activation_bytes(tiny, 256, 32, 1, 1, 1, 1, False, "float32", "local") == peak
    # PP 2 with 4 micro-batches: stage 0 holds 2 in flight of its 2 layers (and the embedding outputs),
    # the last stage 1 of its 2 layers and the loss; TP 2 halves all but the norms and residual sums
    per_layer = sb * (6 * 128 + (6 * 128 + 4 * 512 + 4 * 256) / 2)
    first = 2 * (2 * per_layer + embedding) + buffer / 2 + sb * (2 * 128 + 3 * 512 / 2)
    last = 2 * per_layer + buffer / 2 + max(sb * (2 * 128 + 3 * 512 / 2), sb * (2 * 128 + 3 * 512 / 2))
    assert M.activation_bytes(tiny, 256, 32, 4, 2, 2, 1, False, "float32", "local") == 4 * max(first, last)


def test_kv_cache_of_one_8k_llama3_8b_sequence_is_1_gib():
    # 2 (K, V) x 32 layers x 8192 tokens x 8 groups x 128 x 2 bytes
    assert M.kv_cache_bytes(shape("llama3_8b"), 8192, 1, 1, 1, "bfloat16") == 2 ** 30
    assert M.kv_cache_bytes(shape("llama3_8b", tp=8), 8192, 1, 8, 2, "bfloat16") == 2 ** 30 / 8 / 2


# ---- the time model against published figures -----------------------------------------------------------
# NeMo 24.12 performance summary (docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/
# performance_summary.html), pre-training at FP8 on DGX H100: LLAMA3-8B, 8 GPUs, GBS 128, MBS 1, seq 8192,
# TP1 PP1 CP2: 12,273 tokens/s/GPU; LLAMA3-70B, 64 GPUs, GBS 128, MBS 1, seq 8192, TP4 PP4 CP2 VP5:
# 1,524 tokens/s/GPU.
TRAINING = [("llama3_8b", 8, 1, 1, 2, 12273), ("llama3_70b", 64, 4, 4, 2, 1524)]
TRAINING_FACTOR = 1.35


@pytest.mark.parametrize("model,gpus,tp,pp,cp,published", TRAINING, ids=[t[0] for t in TRAINING])
def test_training_throughput_matches_nemo_published(model, gpus, tp, pp, cp, published):
    s = shape(model, tp=tp)
    dp = gpus // (tp * pp * cp)
    seconds = T.train_seconds(s, 128, 8192, gpus, pp, 128 // dp, H100, fp8=True)
    predicted = 128 * 8192 / seconds / gpus
    print(f"{model}: predicted {predicted:.0f} tokens/s/GPU, published {published}")
    assert 1 / TRAINING_FACTOR < predicted / published < TRAINING_FACTOR


# NeMo-Aligner's docs/user-guide/rlhf.rst ("PPO Performance Results with TensorRT-LLM"): Llama3 70B actor and
# reward model, num_rollout_samples 1024, global_batch_size 128, mean tokens generated and step time per
# layout; Llama 3.1 405B with 128 rollouts. Not published (assumed here, the same for every row): the
# parallel layouts (TP8 PP4 for 70B, TP8 PP21 for 405B (126 layers; DP 4 divides the batch of 128), critic like the actor), 512-token prompts,
# max length 1024 + 1024. NeMo-Aligner generates with TensorRT-LLM; the plan models aligner's in-process
# Megatron engine at the same bandwidth bound.
PPO = [("llama3_70b", 8, 4, 4, 1024, 350.7, 366.7), ("llama3_70b", 16, 8, 4, 1024, 323.3, 190.4),
       ("llama3_70b", 32, 16, 4, 1024, 331.7, 108.0), ("llama3_70b", 64, 32, 4, 1024, 334.0, 56.9),
       ("llama31_405b", 84, 42, 21, 128, 915.6, 164.6)]
PPO_FACTOR = 2.0


@pytest.mark.parametrize("model,nodes,service,pp,rollouts,tokens,published", PPO,
                         ids=[f"{p[0]}-{p[1]}+{p[2]}" for p in PPO])
def test_ppo_step_time_matches_nemo_aligner_published(model, nodes, service, pp, rollouts, tokens, published):
    result = plan("ppo", [f"model={model}", "model.tensor_model_parallel_size=8",
                          f"model.pipeline_model_parallel_size={pp}", "model.sequence_parallel=true",
                          "critic.parallel.tensor_model_parallel_size=8",
                          f"critic.parallel.pipeline_model_parallel_size={pp}", "optim.distributed_optimizer=true",
                          "critic.optim.distributed_optimizer=true", f"algorithm.prompts_per_step={rollouts}",
                          "trainer.global_batch_size=128", "trainer.micro_batch_size=1",
                          "critic.trainer.global_batch_size=128", "critic.trainer.micro_batch_size=1",
                          "data.max_length=1024", "sampling.max_new_tokens=1024", "model.seq_length=2048",
                          "generation.batch_size=8", f"cluster.nodes={nodes}", f"cluster.service_nodes={service}",
                          "plan.prompt_length=512", f"plan.response_length={round(tokens)}"])
    assert result["fits"], result["errors"]
    print(f"{model} {nodes}+{service} nodes: predicted {result['step_time_s']:.1f} s, published {published} s",
          result["timing"])
    assert 1 / PPO_FACTOR < result["step_time_s"] / published < PPO_FACTOR


# ---- LoRA: a frozen base, trained adapters, no reference copy ----------------------------------------------
ALL_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_llama3_70b_rank_16_adapters_by_hand():
    s, lora = shape("llama3_70b", tp=8), M.Lora(16, ALL_LINEARS)
    # r (in + out) a linear: QKV 8192 -> (64 + 2 x 8) x 128 = 10240, proj 8192 -> 8192, fc1 8192 -> 2 x 28672
    # (gate and up), fc2 28672 -> 8192
    layer = 16 * ((8192 + 10240) + (8192 + 8192) + (8192 + 57344) + (28672 + 8192))
    assert layer == 2_195_456 and M.adapter_parameter_count(s, lora) == 80 * layer == 175_636_480
    # TP 8: column-parallel QKV and fc1 keep A whole and split B; row-parallel proj and fc2 split A, keep B whole
    per_gpu_layer = 16 * ((8192 + 10240 // 8) + (8192 // 8 + 8192) + (8192 + 57344 // 8) + (28672 // 8 + 8192))
    assert per_gpu_layer == 733_184
    assert M.adapter_parameters_per_gpu(s, lora, 8, 4) == 20 * per_gpu_layer  # PP 4: 20 layers a stage
    assert M.adapter_parameter_count(s, M.Lora(16, ("linear_qkv",))) == 80 * 16 * (8192 + 10240)


def test_llama3_8b_rank_16_has_35_651_584_adapter_parameters():
    layer = 16 * ((4096 + 6144) + (4096 + 4096) + (4096 + 2 * 14336) + (14336 + 4096))
    assert M.adapter_parameter_count(shape("llama3_8b"), M.Lora(16, ALL_LINEARS)) == 32 * layer == 35_651_584


def test_adapter_activations_and_merged_weights_of_the_tiny_model_by_hand():
    tiny = M.Shape(4, 128, 4, 4, 32, 512, 512)
    sb = 256 * 32
    # the r-wide A x of each of the 4 linears, fp32; under SP at TP 2 the row-parallel ones are split along s
    assert M.adapter_activation_bytes(tiny, M.Lora(8, ALL_LINEARS), 256, 32, 1, False, "float32") == 4 * sb * 8 * 4
    assert M.adapter_activation_bytes(tiny, M.Lora(8, ALL_LINEARS), 256, 32, 2, True, "float32") == (
        4 * sb * 8 * (2 + 2 / 2))
    # dropout: A's input, dropped, and its bool mask: QKV, proj and fc1 read h = 128, fc2 F = 512 (TP 1)
    dropped = M.adapter_activation_bytes(tiny, M.Lora(8, ALL_LINEARS, 0.1), 256, 32, 1, False, "float32")
    assert dropped == 4 * sb * 8 * 4 + sb * (3 * 128 + 512) * (4 + 1)
    # merged weights: QKV 128 x 384, proj 128 x 128, fc1 128 x 1024, fc2 512 x 128 per layer; fp32: + one
    # B A of the largest (fc1)
    matrices = 128 * 384 + 128 * 128 + 128 * 1024 + 512 * 128
    assert M.merged_weight_bytes(tiny, M.Lora(8, ALL_LINEARS), 1, 1, "float32") == 4 * 4 * matrices + 4 * 128 * 1024
    # bf16, TP 2, PP 2: 2 layers of half matrices in 2 bytes, + fp32 W, B A and their sum of fc1's half
    assert M.merged_weight_bytes(tiny, M.Lora(8, ALL_LINEARS), 2, 2, "bfloat16") == (
        2 * matrices / 2 * 2 + 12 * 128 * 1024 / 2)


def test_a_lora_step_skips_the_frozen_bases_weight_gradients():
    s = shape("llama3_8b")
    tokens, context, adapters = 4096, 4096, 35_651_584
    base = 2 * T.matmul_parameters(s) * tokens
    attention = T.forward_flops(s, tokens, context) - base
    assert T.training_flops(s, tokens, context) == 3 * (base + attention)
    lora = T.training_flops(s, tokens, context, adapters=adapters)
    assert lora == 2 * base + 3 * (attention + 2 * adapters * tokens)
    assert T.training_flops(s, tokens, context, "full", adapters) == 3 * base + 4 * (attention + 2 * adapters * tokens)
    assert 0.68 < lora / T.training_flops(s, tokens, context) < 0.75  # about a third less at 4k tokens


PPO_70B = ["model=llama3_70b", "model.pipeline_model_parallel_size=4", "critic.parallel.pipeline_model_parallel_size=4",
           "critic.launcher.nproc_per_node=32", "algorithm.prompts_per_step=256", "trainer.global_batch_size=128",
           "critic.trainer.global_batch_size=128", "critic.trainer.micro_batch_size=1", "data.max_length=1024",
           "sampling.max_new_tokens=1024", "model.seq_length=2048", "generation.batch_size=64", "cluster.nodes=4",
           "cluster.service_nodes=4"]


def test_a_lora_plan_has_no_base_gradients_optimizer_states_or_reference_copy():
    full, lora = plan("ppo", PPO_70B), plan("ppo", [*PPO_70B, "model.lora.rank=16"])
    assert full["fits"] and lora["fits"], (full["errors"], lora["errors"])
    actor, gib = lora["components"]["actor"], 2 ** 30
    adapters = actor["adapter_parameters"]
    assert adapters == 20 * 733_184
    assert actor["params_gib"] == round((actor["parameters"] + adapters) * 2 / gib, 3)  # bf16, base + adapters
    assert actor["grads_gib"] == round(adapters * 4 / gib, 3)  # fp32 buffer of the adapters only
    assert actor["optimizer_gib"] == round(adapters * 12 / gib, 3)  # bf16: master + m + v (DP 1)
    assert actor["lora"] == {"rank": 16, "target_modules": list(ALL_LINEARS), "adapter_parameters": 175_636_480,
                             "base_parameters": M.parameter_count(shape("llama3_70b", tp=8))}
    assert full["components"]["reference"]["memory_gib_per_gpu"] > 4
    assert lora["components"]["reference"]["memory_gib_per_gpu"] == 0.0
    assert lora["components"]["actor"]["activations_gib"] >= full["components"]["actor"]["activations_gib"]
    assert lora["components"]["generation"]["merged_gib"] > 4  # the lean decoder's merged copy of the matrices
    assert lora["components"]["critic"] == full["components"]["critic"]  # critic.lora unset: a full critic
    assert lora["timing"]["train_s"] < 0.75 * full["timing"]["train_s"]
    assert lora["timing"]["reference_s"] == full["timing"]["reference_s"]  # the base's forward still runs


def test_the_plan_says_the_actor_is_lora_and_the_reference_costs_nothing():
    from aligner.plan.cli import table  # why: the readable form; the module's import gives plan only

    printed = table(plan("ppo", [*PPO_70B, "model.lora.rank=16"]))
    assert ("actor is LoRA rank 16 on linear_qkv, linear_proj, linear_fc1, linear_fc2: 175.6M adapter parameters "
            "(0.25% of the base's 70.57B, frozen: no gradients or optimizer states); the reference is the base "
            "with the adapters off: no weights of its own") in printed


def test_a_lora_run_with_a_reference_copy_is_refused():
    result = plan("grpo", ["model.vocab_size=512", "model.lora.rank=8", "reference.mode=model", "cluster.gpu=cpu",
                           "cluster.memory_gib=8"])
    assert not result["fits"]
    assert result["errors"] == ["reference.mode=model contradicts model.lora.rank=8: a LoRA run's reference is its "
                                "frozen base (the adapters off), with no copy; set reference.mode=null"]


def test_a_lora_critic_trains_its_adapters_and_value_head_only():
    overrides = [*PPO_70B, "critic.lora.rank=8", "critic.lora.target_modules=[linear_qkv,linear_proj]"]
    full, result = plan("ppo", PPO_70B), plan("ppo", overrides)
    critic, s = result["components"]["critic"], shape("llama3_70b", tp=8)
    lora = M.Lora(8, ("linear_qkv", "linear_proj"))
    trained = M.adapter_parameters_per_gpu(s, lora, 8, 4) + 8192  # + the value head (hidden x 1)
    assert critic["adapter_parameters"] == 20 * 8 * ((8192 + 10240 // 8) + (8192 // 8 + 8192))
    assert critic["grads_gib"] == round(trained * 4 / 2 ** 30, 3)
    assert critic["lora"]["adapter_parameters"] == M.adapter_parameter_count(s, lora)
    assert "lora" not in result["components"]["actor"]
    # its base is the reward model (critic.checkpoint unset): scoring switches the adapters off, no swap
    assert full["components"]["reward"]["host_gib"] > 4 and result["components"]["reward"]["host_gib"] == 0.0
    assert result["timing"]["critic_infer_s"] < full["timing"]["critic_infer_s"]
    swapped = plan("ppo", [*overrides, "critic.checkpoint=/some/other/critic"])
    assert swapped["components"]["reward"] == full["components"]["reward"]
