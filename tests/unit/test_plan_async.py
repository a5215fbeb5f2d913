"""`aligner plan` for issue 35: separate rollout workers (their GPUs, memory and the step with the weight broadcast)
and online RL under context parallelism, against hand-computed cases."""
import pytest

from aligner.plan import memory as M
from aligner.plan.cli import plan
from aligner.plan.estimate import step_seconds

GIB = 1024 ** 3
# Llama-3-70B GRPO, the trainer TP8 PP4 on 4 nodes (DP 1); 16 prompts x 4 = 64 samples of 1024 + 1024 tokens
LLAMA_70B = ["model=llama3_70b", "model.tensor_model_parallel_size=8", "model.pipeline_model_parallel_size=4",
             "model.sequence_parallel=true", "model.seq_length=2048", "data.max_length=1024",
             "sampling.max_new_tokens=1024", "algorithm.prompts_per_step=16", "trainer.global_batch_size=64",
             "trainer.micro_batch_size=1", "optim.distributed_optimizer=true", "cluster.nodes=4",
             "plan.prompt_length=512", "plan.response_length=512"]


def separate(workers: int, tp: int, lag: int) -> list[str]:
    return ["generation.placement=separate", f"generation.workers={workers}",
            f"generation.tensor_model_parallel_size={tp}", f"algorithm.async.max_lag={lag}"]


def test_the_step_overlaps_generation_and_training_only_with_a_lag():
    # generation 10 s, the trainer's passes 6 s, the broadcast 1 s
    assert step_seconds(10.0, 6.0, 1.0, max_lag=0) == 17.0  # wait for the rollouts, train, send the weights
    assert step_seconds(10.0, 6.0, 1.0, max_lag=1) == 11.0  # max(10, 6) + 1
    assert step_seconds(4.0, 6.0, 1.0, max_lag=4) == 7.0  # the trainer is the slower: max(4, 6) + 1
    assert step_seconds(10.0, 6.0, 0.0, max_lag=0) == 16.0  # colocated: no broadcast


def test_a_70b_worker_at_tp8_and_the_gpu_count_and_step_by_hand():
    result = plan("grpo", [*LLAMA_70B, *separate(4, 8, 1), "generation.batch_size=8"])
    assert result["fits"], result["errors"]
    gen = result["components"]["generation"]
    # 4 workers x TP 8 = 32 GPUs of their own, beside the trainer's 4 nodes x 8
    assert gen["gpus"] == 32 and result["cluster"]["gpus"] == 32 + 32
    # a worker's GPU holds the whole model at TP 8, PP 1: 80 layers, the embedding and output shards, the final norm
    matrices = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672
    weights = 2 * (80 * (matrices // 8 + 2 * 8192) + 2 * 129024 * 8192 // 8 + 8192)
    assert gen["params_gib"] == round(weights / GIB, 3) == 16.432
    # KV of 8 (generation.batch_size) of its 16 samples: 2 x 80 layers x 2048 tokens x 8 x 1 group a rank x 128 x 2 B
    kv = 2 * 80 * 2048 * 8 * 1 * 128 * 2
    assert gen["kv_cache_gib"] == round(kv / GIB, 3) == 0.625
    # the largest bucket of the weight stream, the output layer (129024 x 8192 bf16), exceeds KV + logits
    bucket = 129024 * 8192 * 2
    assert bucket > kv + 8 * 129024 * 4
    assert gen["memory_gib_per_gpu"] == round((weights + bucket) / GIB, 3)
    # the broadcast: the whole 70.6B-parameter model in bf16 over rank 0's 50 GB/s InfiniBand port
    t = result["timing"]
    parameters = 80 * (matrices + 2 * 8192) + 2 * 129024 * 8192 + 8192
    assert t["broadcast_s"] == pytest.approx(2 * parameters / 50e9, abs=1e-6)
    trainer = t["logprobs_s"] + t["reference_s"] + t["train_s"]
    assert result["step_time_s"] == pytest.approx(max(t["generate_s"], trainer) + t["broadcast_s"], abs=1e-5)
    lag0 = plan("grpo", [*LLAMA_70B, *separate(4, 8, 0), "generation.batch_size=8"])
    assert lag0["step_time_s"] == pytest.approx(t["generate_s"] + trainer + t["broadcast_s"], abs=1e-5)


def test_a_worker_at_a_smaller_tp_holds_more_of_the_model():
    gen = plan("grpo", [*LLAMA_70B, *separate(8, 4, 1), "generation.batch_size=8"])["components"]["generation"]
    matrices = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672
    # the vocabulary padded to a multiple of 128 x TP 4 = 512: 128256 -> 128512 (129024 at the trainer's TP 8)
    weights = 2 * (80 * (matrices // 4 + 2 * 8192) + 2 * 128512 * 8192 // 4 + 8192)
    assert gen["gpus"] == 32 and gen["params_gib"] == round(weights / GIB, 3)
    # 8 of its 8 samples, 2 of the 8 query groups a rank
    assert gen["kv_cache_gib"] == round(2 * 80 * 2048 * 8 * 2 * 128 * 2 / GIB, 3)


def test_context_parallelism_halves_the_rl_trainers_activations_as_for_sft():
    grpo = [*LLAMA_70B, "cluster.nodes=8", "generation.batch_size=64"]
    cp1, cp2 = (plan("grpo", [*grpo, f"model.context_parallel_size={cp}"]) for cp in (1, 2))
    assert cp2["fits"] and not cp2["errors"], cp2["errors"]  # no longer refused
    s = M.Shape(80, 8192, 64, 8, 128, 28672, 129024)
    # the loss reads the logits of the 1024 response tokens, the sequence's last 1024: under CP 2 its 4 chunks of
    # 512 are (0, 3) on rank 0 and (1, 2) on rank 1, so each rank holds 512 of them
    assert [M.response_rows_per_cp_rank(2048, 1024, cp) for cp in (1, 2, 4)] == [1024, 512, 256]
    assert M.response_rows_per_cp_rank(2048, 256, 2) == 256  # all in chunk 3, rank 0's
    for cp, result, dp, rows in ((1, cp1, 2, 1024), (2, cp2, 1, 512)):
        # the whole 2048-token sequence split over the CP ranks; 64 / (1 x DP) micro-batches in flight
        acts = M.activation_bytes(s, 2048, 1, 64 // dp, 8, 4, cp, True, "bfloat16", "te", logit_tokens=rows)
        assert result["components"]["actor"]["activations_gib"] == round(acts / GIB, 3)
    assert cp2["components"]["actor"]["activations_gib"] < 0.6 * cp1["components"]["actor"]["activations_gib"]
    # colocated generation: each CP rank is one more engine replica, so the step's 64 samples are split over
    # DP x CP = 2 replicas either way: the same KV cache a GPU
    assert cp2["components"]["generation"]["kv_cache_gib"] == cp1["components"]["generation"]["kv_cache_gib"] == \
        round(2 * 20 * 2048 * 32 * 1 * 128 * 2 / GIB, 3)


@pytest.mark.parametrize("overrides,fix", [
    (["generation.placement=separate", "generation.workers=0"], "set generation.workers >= 1"),
    (["generation.placement=separate", "generation.tensor_model_parallel_size=3"],
     "set generation.tensor_model_parallel_size to one of [1, 2, 4]"),
    (["algorithm.async.max_lag=1"], "set generation.placement=separate"),
    (["generation.placement=separate", "algorithm.async.max_lag=-1"], "is negative"),
    (["model.context_parallel_size=2", "launcher.nproc_per_node=2", "generation.decode=megatron"],
     "set generation.decode=auto"),
], ids=["no_workers", "worker_tp", "lag_colocated", "negative_lag", "cp_megatron_decode"])
def test_bad_placements_are_refused_with_their_fix(overrides, fix):
    result = plan("grpo", ["model.vocab_size=512", "cluster.gpu=cpu", "cluster.memory_gib=8", *overrides])
    assert not result["fits"] and any(fix in e for e in result["errors"]), result["errors"]
