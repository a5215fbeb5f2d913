"""The planner's memory model against real CPU runs: each run's measured peak of tensor memory per rank is
within +-15% of `aligner plan`'s figure for the same config (cluster.gpu=cpu: fp32 parameters, fp32 gradient
buffer, Adam's two fp32 states, the local layer spec's activations and the backward's gradients at the peak).

How memory is measured (tests/plan_memory_worker.py): each rank starts torch's profiler with memory recording
just before megatron builds the first GPTModel and stops it after the trainer's last step (two optimizer
steps: Adam's states exist from the first one on). c10's CPU allocator reports every allocation and free made
while profiling together with its running total of live bytes; the total's maximum is the exact peak of the
tensor memory the run added (the plan's subject). Asserted: the max over ranks of that peak.
Printed, not asserted: the resident-set peak over the same interval (VmHWM - VmRSS before the model), which
is larger: glibc keeps freed blocks it cannot reuse for a later, differently sized request (heap
fragmentation; aligner/runtime/cpu_memory.py keeps freed memory in the process on purpose), and it also
counts the modules imported after the start, gloo's buffers, the data loader and Python objects.
Sizes: the tiny model with a large micro-batch (activations dominate) and a hidden-512, 8-layer model
(weights, gradients and Adam dominate), SFT with TP, DPO with PP and a reference, GRPO with DP, the
distributed optimizer, a reference and the in-process generation engine, and DPO with LoRA adapters at TP 2
(the base frozen: no gradients, no Adam state, no reference copy; the worker saves the base it loads). For
LoRA the adapter parameters a rank trains are also counted and must equal the plan's exactly (the TP split
of column- and row-parallel adapters). Checkpoints, validation and TensorBoard are off: they are not part of
a training step.
"""
import json
import random
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env

TOLERANCE = 0.15
MIB = 1024 ** 2
H512 = ["model.hidden_size=512", "model.num_layers=8", "model.num_attention_heads=8", "model.ffn_hidden_size=2048",
        "model.seq_length=128"]
COMMON = ["trainer.max_steps=2", "trainer.save_last=false", "trainer.val_interval=0", "logging.tensorboard=false",
          "logging.progress=false", "optim.warmup_steps=0"]
CASES = {
    "tiny sft 1 rank (activations)": ("sft", 1, ["model.seq_length=256", "trainer.micro_batch_size=32",
                                                  "trainer.global_batch_size=32"]),
    "h512 sft TP2": ("sft", 2, [*H512, "model.tensor_model_parallel_size=2", "trainer.micro_batch_size=4",
                                "trainer.global_batch_size=8"]),
    "h512 dpo PP2 + reference": ("dpo", 2, [*H512, "model.pipeline_model_parallel_size=2", "data.packing=false",
                                            "data.overlong=truncate", "trainer.micro_batch_size=2",
                                            "trainer.global_batch_size=4"]),
    "h512 grpo DP2 dist-opt + reference": ("grpo", 2, [*H512, "optim.distributed_optimizer=true", "data.packing=false",
                                                       "trainer.max_steps=1", "algorithm.prompts_per_step=8",
                                                       "algorithm.num_generations=2",
                                                       "trainer.micro_batch_size=4", "trainer.global_batch_size=8",
                                                       "sampling.max_new_tokens=48", "data.max_length=64",
                                                       "reward.functions=[arithmetic]", "reward.workers=1"]),
    "h512 dpo TP2 LoRA r8 (frozen base, no reference copy)": ("dpo", 2, [
        *H512, "model.tensor_model_parallel_size=2", "model.lora.rank=8", "data.packing=false",
        "data.overlong=truncate", "trainer.micro_batch_size=2", "trainer.global_batch_size=4"]),
}


def _long_text(rng, words: int) -> str:
    return " ".join(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}={rng.randint(0, 198)}" for _ in range(words))


@pytest.fixture(scope="module")
def data(tiny_assets, tmp_path_factory, tokenizer):
    """Records longer than every max_length here (truncated to it), so each batch is padded to the plan's
    length; RL prompts of 60-64 tokens (data.max_length=64 drops longer ones)."""
    root, rng = tmp_path_factory.mktemp("plan_memory"), random.Random(0)
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"input": "Q:", "output": _long_text(rng, 200)}) + "\n" for _ in range(64)))
    pref = root / "pref.jsonl"
    pref.write_text("".join(json.dumps({"prompt": "Q:", "chosen": _long_text(rng, 100), "rejected": _long_text(rng, 100)})
                            + "\n" for _ in range(32)))
    prompts, rows = root / "prompts.jsonl", []
    while len(rows) < 16:
        ids = tokenizer(_long_text(rng, 30))["input_ids"][:62]
        text = tokenizer.decode(ids)
        if 60 <= len(tokenizer(text)["input_ids"]) <= 64:
            rows.append(json.dumps({"prompt": text, "answer": "1"}))
    prompts.write_text("\n".join(rows) + "\n")
    return {"sft": sft, "dpo": pref, "grpo": prompts, "tokenizer": tiny_assets / "tokenizer"}


def _measure(algorithm: str, nproc: int, overrides: list[str], data, tmp_path) -> tuple[int, int, int]:
    """(tensor peak, RSS peak, adapter parameters trained), each the max over ranks."""
    out = tmp_path / "memory"
    out.mkdir()
    lora = any(o.startswith("model.lora.rank=") for o in overrides)  # a LoRA run adapts a base: the worker saves it
    args = [algorithm, str(out), f"run_dir={tmp_path / 'run'}", f"data.train_path={data[algorithm]}",
            f"tokenizer.path={data['tokenizer']}", f"launcher.nproc_per_node={nproc}", *COMMON, *overrides,
            *([f"model.pretrained={tmp_path / 'base'}"] if lora else [])]
    result = subprocess.run([sys.executable, "-m", "tests.plan_memory_worker", *args], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    assert len(ranks) == nproc
    for r in ranks:
        print(f"\nrank: tensor peak {r['tensor_peak'] / MIB:.0f} MiB ({r['allocations']} allocations) in "
              f"{' < '.join(r['peak_in'][:4])}; RSS peak {(r['rss_peak'] - r['rss_before']) / MIB:.0f} MiB")
    return (max(r["tensor_peak"] for r in ranks), max(r["rss_peak"] - r["rss_before"] for r in ranks),
            max(r["adapter_parameters"] for r in ranks))


def _planned(algorithm: str, nproc: int, overrides: list[str], data) -> dict:
    from aligner.plan.cli import plan

    result = plan(algorithm, [f"tokenizer.path={data['tokenizer']}", "cluster.gpu=cpu", "cluster.memory_gib=64",
                              f"cluster.gpus_per_node={nproc}", *COMMON, *overrides])
    assert result["fits"], result["errors"]
    return result


@pytest.mark.parametrize("case", CASES)
def test_measured_peak_is_within_15_percent_of_the_plan(case, data, tmp_path):
    algorithm, nproc, overrides = CASES[case]
    planned = _planned(algorithm, nproc, overrides, data)
    components = {k: v["memory_gib_per_gpu"] * 1024 for k, v in planned["components"].items()}
    planned_mib = sum(components.values())
    tensor, rss, adapters = _measure(algorithm, nproc, overrides, data, tmp_path)
    assert adapters == planned["components"]["actor"].get("adapter_parameters", 0)
    measured_mib, rss_mib = tensor / MIB, rss / MIB
    error = measured_mib / planned_mib - 1
    print(f"\n| {case} | {measured_mib:.0f} | {rss_mib:.0f} | {planned_mib:.0f} | {100 * error:+.1f}% | "
          + ", ".join(f"{k} {v:.0f}" for k, v in components.items()) + " |")
    assert abs(error) <= TOLERANCE, (case, measured_mib, planned_mib, components)
