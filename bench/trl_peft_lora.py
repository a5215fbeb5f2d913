"""The TRL + peft peer of bench/lora.py: TRL's SFTTrainer, DPOTrainer and GRPOTrainer with
`peft_config=LoraConfig(r, lora_alpha, target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj])` on the TRL peer baseline's configuration. Runs in the TRL virtual environment (ALIGNER_TRL_PYTHON,
with peft installed: `/tmp/trl-venv/bin/pip install peft`), never in aligner's.

    python bench/trl_peft_lora.py train --trainer sft|dpo|grpo --name NAME [--policy HF_DIR] [--rank 16]
        [--alpha 32] [--batch N] [--memory]
    python bench/trl_peft_lora.py make-model --out HF_DIR --hidden 512 --layers 8 --heads 8 --ffn 2048

`train` uses the peer baseline's own pieces (ALIGNER_TRL_BENCH_DIR, default ../shared/reference/bench-trl:
common.py's datasets, TrainingArguments, step timer and result file) and the trainers' settings of its
bench_sft.py / bench_dpo.py / bench_grpo.py, written out here again with the adapters added. The environment
variables are common.py's: TRL_BENCH_HOME (the artifacts), TRL_BENCH_RESULTS (where NAME.json goes),
BENCH_STEPS, BENCH_WARMUP, BENCH_THREADS. `--rank 0` is full fine-tuning (DPO then gets its explicit
reference copy, as the baseline's bench_dpo.py); with adapters TRL's reference is the base with the adapters
disabled, as aligner's is. `--policy` replaces the baseline's policy (the hidden-512 variant that
`make-model` writes: the baseline's Llama at another shape, the same tokenizer, seeded random init).
`--batch` sets the pairs (DPO) or sequences (SFT) per step, whose default is the baseline's.

`--memory` runs torch's profiler with memory recording from just before the model is loaded to the end of
training, and adds to the result `tensor_peak_bytes`: the largest running total of CPU tensor bytes that
c10's allocator reported while profiling (every allocation and free is reported with that total), i.e. the
peak of the tensor memory the run added after its start; `peak_in` names the ops around that allocation.
bench/lora.py measures aligner's runs the same way from just before megatron builds the model. Timings of
a `--memory` run are not used (the profiler slows every op).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRL_BENCH_DIR = Path(os.environ.get("ALIGNER_TRL_BENCH_DIR", REPO.parent / "shared" / "reference" / "bench-trl"))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


MARKER = "bench::step_end"  # a record_function at the end of each optimizer step (both sides)


def step_peaks(prof) -> dict:
    """Peaks of the running total of CPU tensor bytes the profiler's allocation events carry (module doc):
    `steps`: one per optimizer step, between the MARKER events that end them (the first from the start);
    `tensor_peak_bytes`: the largest of steps 2.. (Adam's states exist; what every later step repeats), or of
    the only one; `run_peak_bytes`: the largest anywhere; `peak_in`: the ops around the allocation that reached
    `tensor_peak_bytes`, innermost first."""
    from torch._C._profiler import _EventType

    allocations, ends, todo = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        kind, fields = node.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            allocations.append((node.start_time_ns, fields.total_allocated, node))
        elif node.name.startswith(MARKER):
            ends.append(node.start_time_ns)
    allocations.sort(key=lambda a: a[0])
    ends.sort()
    steps, i = [], 0
    for end in ends:
        best = None
        while i < len(allocations) and allocations[i][0] < end:
            if best is None or allocations[i][1] > best[1]:
                best = allocations[i]
            i += 1
        steps.append(best)
    run = max(allocations, key=lambda a: a[1])
    later = [s for s in steps[1:] if s is not None] or [s for s in steps if s is not None] or [run]
    peak = max(later, key=lambda a: a[1])
    where, node = [], peak[2].parent
    while node is not None:
        where.append(node.name)
        node = node.parent
    return {"tensor_peak_bytes": peak[1], "run_peak_bytes": run[1],
            "steps": [s[1] if s is not None else None for s in steps], "peak_in": where[:8]}


def mark_step_end(step: int) -> None:
    import torch

    with torch.profiler.record_function(f"{MARKER} {step}"):
        pass


def peft_config(rank: int, alpha: float):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                      task_type="CAUSAL_LM")


def build_trainer(kind: str, model, tok_left, tok_right, rank: int, alpha: float, batch: int | None, common):
    """(trainer, the settings it runs with): the baseline's configuration of `kind`, plus the adapters."""
    run, kw = common.RUN, common.common_args()
    kw["output_dir"] = str(common.RUNS_DIR / f"peft-{kind}")
    lora = {"peft_config": peft_config(rank, alpha)} if rank > 0 else {}
    timer = common.make_step_callback()
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        kw.update(per_device_train_batch_size=batch or run["sft_seqs_per_step"], max_length=run["max_length"],
                  packing=False, padding_free=False, completion_only_loss=True, shuffle_dataset=False)
        args = SFTConfig(**kw)
        trainer = SFTTrainer(model=model, args=args, train_dataset=common.load_dataset_rows("sft"),
                             processing_class=tok_right, callbacks=[timer], **lora)
    elif kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        kw.update(per_device_train_batch_size=batch or run["pref_pairs_per_step"], beta=run["dpo_beta"],
                  loss_type=["sigmoid"], max_length=run["max_length"], precompute_ref_log_probs=False,
                  disable_dropout=True, padding_free=False)
        args = DPOConfig(**kw)
        # full fine-tuning: the baseline's explicit reference copy; LoRA: none (the adapters disabled)
        reference = None if rank > 0 else type(model).from_pretrained(model.name_or_path, dtype=model.dtype)
        trainer = DPOTrainer(model=model, ref_model=reference, args=args,
                             train_dataset=common.load_dataset_rows("prefs"), processing_class=tok_right,
                             callbacks=[timer], **lora)
    elif kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        kw.update(per_device_train_batch_size=run["rl_completions_per_step"], num_generations=run["rl_group_size"],
                  max_completion_length=run["rl_max_new_tokens"], temperature=run["rl_temperature"],
                  top_p=run["rl_top_p"], top_k=run["rl_top_k"], beta=run["rl_kl_beta"], epsilon=run["rl_clip_eps"],
                  num_iterations=run["rl_updates_per_rollout"], steps_per_generation=1, shuffle_dataset=True,
                  disable_dropout=True, use_vllm=False, log_completions=False, scale_rewards="group",
                  loss_type="dapo")
        args = GRPOConfig(**kw)

        def arith(prompts, completions, answer, **_):
            return common.arith_reward(completions, answer)

        trainer = GRPOTrainer(model=model, reward_funcs=[arith], args=args,
                              train_dataset=common.load_dataset_rows("arith"), processing_class=tok_left,
                              callbacks=[timer], **lora)
    else:
        raise SystemExit(f"unknown trainer {kind!r}: sft, dpo or grpo")
    settings = {k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                              "learning_rate", "lr_scheduler_type", "max_grad_norm", "bf16",
                                              "gradient_checkpointing", "seed", "max_steps") if hasattr(args, k)}
    return trainer, timer, settings


def train(a) -> int:
    sys.path.insert(0, str(TRL_BENCH_DIR))
    import common  # the baseline's instrumentation; reads TRL_BENCH_HOME, BENCH_* at import
    import torch

    common.set_threads()
    common.seed_all()
    common.patch_generate()
    started = time.perf_counter()
    tok_left, tok_right = common.load_tokenizer("left"), common.load_tokenizer("right")
    policy = a.policy or str(common.POLICY_DIR)
    prof = None
    if a.memory:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        prof.start()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    common.count_train_tokens(model)
    trainer, timer, settings = build_trainer(a.trainer, model, tok_left, tok_right, a.rank, a.alpha, a.batch, common)
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    extra = {"trainer": type(trainer).__name__, "config": settings, "setup_s": time.perf_counter() - started,
             "lora": {"rank": a.rank, "alpha": a.alpha, "target_modules": TARGETS} if a.rank > 0 else None,
             "trained_parameters": sum(p.numel() for p in trained),
             "has_ref_model": getattr(trainer, "ref_model", None) is not None,
             "policy": policy, "shape": json.loads((Path(policy) / "config.json").read_text())}
    import peft

    extra["peft"] = peft.__version__
    if prof is None:
        common.run_trainer(a.name, trainer, timer, extra)
        return 0
    from transformers import TrainerCallback

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            mark_step_end(int(state.global_step))

    trainer.add_callback(StepEnd())
    trainer.train()
    prof.stop()
    result = {"name": a.name, **step_peaks(prof), **extra}
    peak = result["tensor_peak_bytes"]
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (common.RESULTS_DIR / f"{a.name}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"[bench] {a.name}: tensor peak {peak / 2 ** 20:.1f} MiB", flush=True)
    return 0


def make_model(a) -> int:
    """The baseline's policy architecture at another shape (same tokenizer and special ids), seeded."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    base = json.loads((Path(a.like) / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=base["vocab_size"], hidden_size=a.hidden, intermediate_size=a.ffn,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                      max_position_embeddings=base["max_position_embeddings"], rms_norm_eps=base["rms_norm_eps"],
                      tie_word_embeddings=False, pad_token_id=base["pad_token_id"], bos_token_id=base["bos_token_id"],
                      eos_token_id=base["eos_token_id"])
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id,
                                               bos_token_id=cfg.bos_token_id)
    model.save_pretrained(a.out)
    print(json.dumps({"out": a.out, "parameters": sum(p.numel() for p in model.parameters())}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--trainer", required=True, choices=["sft", "dpo", "grpo"])
    t.add_argument("--name", required=True, help="the result file's name (TRL_BENCH_RESULTS/NAME.json)")
    t.add_argument("--policy", help="HF policy directory (default: the baseline's)")
    t.add_argument("--rank", type=int, default=16, help="LoRA rank; 0: full fine-tuning")
    t.add_argument("--alpha", type=float, default=32.0)
    t.add_argument("--batch", type=int, help="pairs (DPO) or sequences (SFT) per step")
    t.add_argument("--memory", action="store_true", help="measure the peak of tensor bytes (module doc)")
    m = sub.add_parser("make-model")
    m.add_argument("--out", required=True)
    m.add_argument("--like", required=True, help="the baseline's policy directory (vocabulary, special ids)")
    m.add_argument("--hidden", type=int, default=512)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--ffn", type=int, default=2048)
    m.add_argument("--seed", type=int, default=1234)
    a = parser.parse_args()
    return train(a) if a.command == "train" else make_model(a)


if __name__ == "__main__":
    sys.exit(main())
