"""LoRA (issue 34) on CPU, in one run: aligner's LoRA against aligner's full fine-tuning, and against TRL + peft
(the peer) on the same LoRA configuration, for SFT, DPO and GRPO; step time (CPU seconds per step) and peak
tensor memory (measured, and planned by `aligner plan`). Ratios only, each against a peer measured in the same
run.

    python bench/lora.py [--quick] [--repeats 1] [--only CASE ...] [--bounds auto|always|never]
        [--out runs/bench-lora] [--md FILE]

On the 2-core shared VM: about 7 minutes (one round: the tiny cases 15 steps each, the hidden-512 DPO cases 4, the
memory runs, the plans, and the bounds of a missed speed target; 10 minutes with --repeats 3, which made
bench/results/lora-cpu.md); `--quick` about 4-5 (one round of the tiny cases at 10 steps, and the memory of the
hidden-512 DPO pair only, the memory target's).

Configuration: the TRL peer baseline's (bench/preference_vs_trl.py, bench/rl_vs_trl.py: its tokenizer, its
Llama 4L/128h/4 heads/ffn 512/vocab 512 policy, its data), fp32, AdamW lr 1e-5 constant, no weight decay,
grad-clip 1.0, seed 1234, 1 torch thread per process:
  * SFT: 32 prompt/completion sequences a step (sft.jsonl; aligner reads the same rows as input/output
    records), loss on the completion, max_length 256; aligner packs its rows (data.packing=true, the padded
    results), TRL pads them (the baseline's bench_sft.py);
  * DPO: 16 pairs a step, beta 0.1, sigmoid loss, the reference's log-probs every step; aligner packed
    (a pair's prompt once). Full fine-tuning keeps a reference copy (reference.mode=model, TRL's explicit
    ref_model); LoRA's reference is the base with the adapters off on both sides (aligner's default; TRL does
    it itself when given a peft_config);
  * GRPO: 8 prompts x 4 samples, 16 new tokens, k3 KL (beta 0.04) in the loss, token-mean, one update per
    rollout (bench/rl_vs_trl.py's case, the baseline's exact-answer reward);
  * DPO on the hidden-512 model (8 layers, hidden 512, 8 heads, ffn 2048, 34.1M parameters: the size
    tests/integration/test_plan_memory.py and bench/generate.py use), the baseline's Llama at that shape with the
    same tokenizer and a seeded random init (bench/trl_peft_lora.py make-model), the same 16-pair step.
LoRA: rank 16, alpha 32, no dropout. aligner: `model.lora.rank=16 model.lora.alpha=32` (adapters on linear_qkv,
linear_proj, linear_fc1, linear_fc2; QKV's and gate/up's input matrix A shared, as megatron fuses those
linears); TRL: `peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=[q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj])` (bench/trl_peft_lora.py, which drives the baseline's own instrumentation).

TRL runs in its own virtual environment (ALIGNER_TRL_PYTHON, default /tmp/trl-venv/bin/python; created as in
bench/preference_vs_trl.py's doc, plus `/tmp/trl-venv/bin/pip install peft`: peft 0.21.2 here).

Measurements:
  * Time: the process's (aligner: its process tree's, with the reward worker) CPU seconds per step over the
    timed steps (after --warmup), as bench/preference_vs_trl.py; with 1 thread it hardly moves under other
    load, so every ratio is taken on it. Each ratio pairs a run with its peer's run of the same round
    (`--repeats` rounds, interleaved); the table gives their median and each. "other cores": other processes'
    mean core use during a run (over ~0.3 the wall times are contaminated, the CPU times much less).
  * Memory, measured: a separate run of 3 optimizer steps per case under torch's profiler with memory
    recording, from just before the model is built (aligner: megatron's first GPTModel, TRL: from_pretrained)
    to the end: the running total of live CPU tensor bytes that c10's allocator reports with every allocation
    (tests/plan_memory_worker.py's method; for TRL bench/trl_peft_lora.py --memory), the same counter on both
    sides. The peak is the largest of steps 2 and 3, each step's window closed by a marker at its metrics line
    (aligner) or step-end callback (TRL): Adam's states exist from step 1's update on, and aligner's full and
    LoRA runs read the same batches in those steps. The whole run's peak (step 1 included) is reported too:
    full fine-tuning has no Adam state during step 1, so when step 1's batch is the largest, the two whole-run
    peaks fall on different batches.
  * Memory, planned: `aligner plan ALGORITHM <the run's overrides> cluster.gpu=cpu --json`, actor + reference +
    generation. The planner sizes activations for the longest sequences the config allows (data.max_length,
    256 here, + sampling.max_new_tokens for RL: the worst case, "plan @max"); "plan @run" is the same plan at
    the run's mean tokens per sequence (data.max_length set to it), the figure to set beside the measured one.
  * Bounds, where a speed target is missed (the way bench/rl_lean_bound.py bounds RL): the floor (the step's
    dense matmul FLOPs at this core's best GEMM rate: LoRA's base forward twice (forward and input gradient,
    no weight gradient) plus the reference's forward, plus generation for GRPO), and the lean bound: the
    baseline's HF Llama with the same rank-16 adapters on its seven linears (a plain W x + s B A x, the base
    frozen), compiled with torch.compile, no framework: one DPO or GRPO train step (forward, loss, backward,
    clipping, AdamW on the adapters) plus the reference's forward (adapters off), the logits only at the
    positions a loss reads (the responses), and for GRPO generation credited at its floor. DPO's lean rows are
    each pair's prompt + chosen + rejected in one causal row (the packed pair's token count). For GRPO also the
    Megatron actor's bound (bench/lora_module_bound.py): the GPTModel aligner trains, with the adapters and no
    trainer, its reference and train passes on the same batch (the faster of eager and torch.compile), plus
    generation's decode-shaped matrix products. TRL + peft's step over a bound bounds the speed-up any
    implementation (for the last one: any built on the Megatron model) reaches.

Measured 2026-12-07 (bench/results/lora-cpu.md, --repeats 3, a host without AVX-512): TRL + peft / aligner LoRA,
CPU s/step, paired by round: SFT 1.52x, DPO 2.03x (1.99-2.68), GRPO 1.73x (1.42-1.81), DPO hidden-512 2.13x;
aligner full / LoRA: 0.93-1.09x on the tiny model, 1.14x at hidden 512. Peak tensor memory, LoRA / full: 0.545x for
DPO hidden-512 (0.605x over the whole 3-step run), 0.70-0.85x on the tiny model. GRPO's 2x is missed. The
Megatron model's own passes cost what aligner's reference and train phases cost (within this host's noise), and
with an overhead-free decoder they would make a 0.183 s step, 2.41x TRL + peft: the gap is aligner's generation
(0.0705 s, 2.4x its decode-shaped products) and the rest of its step (0.018 s). On 2026-11-28's host (AVX-512) the
same code measured GRPO 1.26x and DPO 2.71x: the ratios move with the host.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.preference_vs_trl import OFFLINE, TRL_BENCH_DIR, TRL_PYTHON, prepare, timed  # noqa: E402
from bench.rl_vs_trl import RUN as RL_RUN, grpo_overrides, timed_tree  # noqa: E402
from bench import lora_module_bound as module_bound  # noqa: E402
from bench.trl_peft_lora import mark_step_end, step_peaks  # noqa: E402

RANK, ALPHA = 16, 32.0
H512 = {"hidden": 512, "layers": 8, "heads": 8, "ffn": 2048}
GIB = 1024 ** 3
MIB = 1024 ** 2
TARGET_MEMORY = 0.6  # LoRA DPO's peak over full DPO's, hidden-512
TARGET_SPEED = 2.0  # TRL + peft's CPU s/step over aligner LoRA's, DPO and GRPO
OPTIM = ["optim.lr=1e-5", "optim.min_lr=1e-6", "optim.scheduler=constant", "optim.warmup_steps=0",
         "optim.weight_decay=0.0", "optim.adam_beta1=0.9", "optim.adam_beta2=0.999", "optim.adam_eps=1e-8",
         "optim.clip_grad=1.0"]
PLAN_CPU = ["cluster.gpu=cpu", "cluster.memory_gib=64"]


def cases() -> dict:
    """name -> (task, model, side, mode): task sft|dpo|grpo, model tiny|h512, side trl|aligner, mode full|lora."""
    out = {}
    for task, model in (("sft", "tiny"), ("dpo", "tiny"), ("grpo", "tiny"), ("dpo", "h512")):
        suffix = f"{task}_h512" if model == "h512" else task
        out[f"trl_peft_{suffix}"] = (task, model, "trl", "lora")
        out[f"aligner_full_{suffix}"] = (task, model, "aligner", "full")
        out[f"aligner_lora_{suffix}"] = (task, model, "aligner", "lora")
    out["trl_full_dpo_h512"] = ("dpo", "h512", "trl", "full")  # memory only: TRL's own full-vs-LoRA ratio
    return out


MEMORY_ONLY = ("trl_full_dpo_h512",)
MEMORY_STEPS = 3  # the peak is that of steps 2.. (module doc)
QUICK_MEMORY = ("aligner_full_dpo_h512", "aligner_lora_dpo_h512")  # --quick: the memory target's pair only


# ---- preparation -------------------------------------------------------------------------------------------
def prepare_all(out: Path, threads: int) -> dict:
    """The baseline's artifacts and their aligner checkpoint (bench/preference_vs_trl.prepare), the hidden-512
    variant (HF and aligner), and the SFT rows as aligner's input/output records."""
    paths = prepare(out, threads)
    h512 = out / "h512"
    env = {**os.environ, **OFFLINE}
    if not (h512 / "policy" / "config.json").exists():
        subprocess.run([TRL_PYTHON, str(REPO / "bench" / "trl_peft_lora.py"), "make-model",
                        "--out", str(h512 / "policy"),
                        "--like", str(paths["art"] / "policy"), *[f"--{k}={v}" for k, v in H512.items()]],
                       env=env, check=True, capture_output=True)
    if not (h512 / "policy_mcore" / "COMPLETE").exists():
        timed([sys.executable, "-m", "aligner.cli", "convert", "hf-to-mcore", "--hf", str(h512 / "policy"), "--out",
               str(h512 / "policy_mcore")], os.environ.copy(), REPO, out / "convert_h512.log")
    sft = out / "sft_io.jsonl"
    if not sft.exists():
        rows = [json.loads(line) for line in (paths["art"] / "data" / "sft.jsonl").read_text().splitlines()]
        sft.write_text("".join(json.dumps({"input": r["prompt"], "output": r["completion"]}) + "\n" for r in rows))
    return {**paths, "out": out, "sft": sft,
            "policy": {"tiny": out / "policy_mcore", "h512": h512 / "policy_mcore"},
            "hf_policy": {"tiny": paths["art"] / "policy", "h512": h512 / "policy"}}


# ---- aligner -----------------------------------------------------------------------------------------------
def aligner_overrides(task: str, model: str, mode: str, paths: dict, out: Path, run_dir: Path, steps: int,
                      threads: int) -> list[str]:
    lora = ([f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA:g}", "model.lora.dropout=0.0"]
            if mode == "lora" else [])
    if task == "grpo":
        return [*grpo_overrides(paths, out, run_dir, steps, threads), "algorithm.advantage=grpo",
                "algorithm.kl.estimator=k3", "algorithm.kl.mode=loss", "algorithm.aggregation=token_mean",
                f"generation.decode={paths['decode']}", *lora]
    art = paths["art"]
    common = [f"run_dir={run_dir}", f"tokenizer.path={art / 'tokenizer'}", f"model.pretrained={paths['policy'][model]}",
              f"trainer.max_steps={steps}", "trainer.seed=1234", "trainer.save_last=false", "data.max_length=256",
              "data.packing=true", "logging.progress=false", "logging.tensorboard=false",
              f"launcher.threads_per_rank={threads}", *OPTIM, *lora]
    if task == "sft":
        return [*common, f"data.train_path={paths['sft']}", "trainer.global_batch_size=32",
                "trainer.micro_batch_size=32"]
    reference = [] if mode == "lora" else ["reference.mode=model"]
    return [*common, f"data.train_path={art / 'data' / 'prefs.jsonl'}", "trainer.global_batch_size=16",
            "trainer.micro_batch_size=16", "dpo.beta=0.1", "dpo.loss_type=sigmoid", *reference]


def aligner_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_aligner(name: str, case: tuple, paths: dict, out: Path, steps: int, warmup: int, threads: int,
                attempt: int) -> dict:
    task, model, _, mode = case
    run_dir = out / f"{name}.{attempt}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = aligner_overrides(task, model, mode, paths, out, run_dir, steps, threads)
    load = timed_tree([sys.executable, "-m", "aligner.cli", "train", task, *overrides], aligner_env(threads), REPO,
                      out / f"{name}.{attempt}.log", run_dir / "metrics.jsonl")
    cpu = load.pop("step_cpu")
    for key in ("step_service_cpu", "cmdlines", "service_pids"):
        load.pop(key)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at = [i for i, m in enumerate(lines) if "timing/step_s" in m]
    metrics = [lines[i] for i in at][warmup:]
    phases = {k[len("timing/"):-2]: statistics.median(m[k] for m in metrics)
              for k in metrics[0] if k.startswith("timing/") and k.endswith("_s")}
    result = {"step_s": statistics.median(m["timing/step_s"] for m in metrics),
              "cpu_step_s": (cpu[at[steps - 1]] - cpu[at[warmup - 1]]) / (steps - warmup), "phases": phases, **load}
    if task == "grpo":
        result["tokens_per_seq"] = (statistics.fmean(m["response_length/mean"] for m in metrics)
                                    + prompt_tokens(paths, "arith"))
    else:
        seqs = 32
        result["tokens_per_seq"] = statistics.fmean(m["throughput/tokens_per_s"] * m["timing/step_s"]
                                                    for m in metrics) / seqs
    return result


def prompt_tokens(paths: dict, data: str) -> float:
    info = json.loads((paths["art"] / "setup_info.json").read_text())
    return info[f"{data}_prompt_tokens_mean"]


def memory_aligner(name: str, case: tuple, paths: dict, out: Path, threads: int) -> dict:
    """A MEMORY_STEPS run of the case under the profiler (this file's `_memory` mode, in a fresh process)."""
    task, model, _, mode = case
    run_dir = out / f"{name}.memory"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    result = out / f"{name}.memory.json"
    overrides = aligner_overrides(task, model, mode, paths, out, run_dir, MEMORY_STEPS, threads)
    timed([sys.executable, str(Path(__file__).resolve()), "_memory", str(result), task, *overrides],
          aligner_env(threads), REPO, out / f"{name}.memory.log")
    return json.loads(result.read_text())


def _memory(argv: list[str]) -> None:
    """`_memory OUT.json ALGORITHM OVERRIDES...`: `aligner train` in this process (one rank), the profiler started
    just before megatron builds the first model; OUT.json gets the tensor peak (module doc)."""
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel

    from aligner import cli
    from aligner.observe.metrics import MetricsLog

    out, algorithm, overrides = argv[0], argv[1], argv[2:]
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    build, models = GPTModel.__init__, []

    def profiled_build(self, *args, **kwargs):
        if not models:
            prof.start()
        build(self, *args, **kwargs)
        models.append(self)

    log = MetricsLog.log

    def logged(self, step, metrics):  # a line per optimizer step (log_interval 1, no validation here)
        mark_step_end(step)
        log(self, step, metrics)

    GPTModel.__init__, MetricsLog.log = profiled_build, logged
    if cli.train(algorithm, overrides):
        sys.exit(f"aligner train {algorithm} failed")
    prof.stop()
    trained = sum(p.numel() for m in models for p in m.parameters() if p.requires_grad)
    Path(out).write_text(json.dumps({**step_peaks(prof), "models_built": len(models), "trained_parameters": trained}))


def plan_requests(case: tuple, paths: dict, out: Path, threads: int, tokens_per_seq: float | None) -> dict:
    """{"max" | "run": (algorithm, overrides)}: `aligner plan` of the case on this CPU at the config's
    data.max_length, and at the run's mean tokens per sequence (RL: data.max_length the prompt's mean, the
    responses being max_new_tokens long)."""
    task, model, _, mode = case
    overrides = [*aligner_overrides(task, model, mode, paths, out, out / "plan", 2, threads), *PLAN_CPU]
    if task == "grpo":
        overrides.append(f"plan.prompt_length={round(prompt_tokens(paths, 'arith'))}")
    requests = {"max": (task, overrides)}
    if tokens_per_seq:
        at_run = prompt_tokens(paths, "arith") if task == "grpo" else tokens_per_seq
        requests["run"] = (task, [*overrides, f"data.max_length={max(1, round(at_run))}"])
    return requests


def planned(requests: dict, threads: int) -> dict:
    """{case: {key: {"bytes", "components"}}} for plan_requests' of each case, in one fresh process (`_plan`)."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_plan"], input=json.dumps(requests),
                          env=aligner_env(threads), cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"aligner plan failed: {proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def _plan(argv: list[str]) -> None:
    """`_plan` < {case: {key: [algorithm, overrides]}}: prints {case: {key: {"bytes": the trainer's GPU's
    actor + reference + generation, "components"}}} as one JSON line."""
    from aligner.plan.cli import plan

    result = {}
    for name, requests in json.load(sys.stdin).items():
        result[name] = {}
        for key, (algorithm, overrides) in requests.items():
            components = plan(algorithm, overrides)["components"]
            gib = sum(c["memory_gib_per_gpu"] for n, c in components.items()
                      if n in ("actor", "reference", "generation"))
            result[name][key] = {"bytes": gib * GIB, "components": components}
    print(json.dumps(result))


# ---- TRL + peft --------------------------------------------------------------------------------------------
def trl_env(paths: dict, results: Path, steps: int, warmup: int, threads: int) -> dict:
    return {**os.environ, **OFFLINE, "TRL_BENCH_HOME": str(paths["trl_home"]), "TRL_BENCH_RESULTS": str(results),
            "BENCH_STEPS": str(steps), "BENCH_WARMUP": str(warmup), "BENCH_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "ALIGNER_TRL_BENCH_DIR": str(TRL_BENCH_DIR)}


def trl_cmd(name: str, case: tuple, paths: dict) -> list[str]:
    task, model, _, mode = case
    return [TRL_PYTHON, str(REPO / "bench" / "trl_peft_lora.py"), "train", "--trainer", task, "--name", name,
            "--policy", str(paths["hf_policy"][model]), "--rank", str(RANK if mode == "lora" else 0),
            "--alpha", f"{ALPHA:g}"]


def run_trl(name: str, case: tuple, paths: dict, out: Path, steps: int, warmup: int, threads: int,
            attempt: int) -> dict:
    results = out / "trl_results" / str(attempt)
    load = timed(trl_cmd(name, case, paths), trl_env(paths, results, steps, warmup, threads), REPO,
                 out / f"{name}.{attempt}.log")
    del load["step_cpu"]
    r = json.loads((results / f"{name}.json").read_text())
    timed_steps = r["per_step"][warmup:]
    tokens = r["train_tokens_per_step"] / 32  # sequences a step: 32 in every case
    return {"step_s": r["median_step_s"], "cpu_step_s": statistics.fmean(s["cpu_s"] for s in timed_steps),
            "phases": {"generate": r["median_gen_s_per_step"]}, "tokens_per_seq": tokens,
            "trained_parameters": r["trained_parameters"], "peak_rss_mb": r["peak_rss_mb"], **load}


def memory_trl(name: str, case: tuple, paths: dict, out: Path, threads: int) -> dict:
    results = out / "trl_results" / "memory"
    timed([*trl_cmd(name, case, paths), "--memory"], trl_env(paths, results, MEMORY_STEPS, 0, threads), REPO,
          out / f"{name}.memory.log")
    return json.loads((results / f"{name}.json").read_text())


# ---- bounds ------------------------------------------------------------------------------------------------
def bounds(task: str, paths: dict, threads: int, response_tokens: float) -> dict:
    """The floor and the lean bound of `task` (dpo | grpo) on the tiny model, CPU s/step (module doc)."""
    env = {**aligner_env(threads), "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "_lean", task, str(paths["hf_policy"]["tiny"]),
           str(paths["art"] / "data"), str(paths["art"] / "tokenizer"), str(threads), str(response_tokens)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the lean bound of {task} failed: {proc.stderr.strip()[-3000:]}")
    out = json.loads(proc.stdout.splitlines()[-1])
    if task == "grpo":  # the same step on the Megatron GPTModel that aligner trains (bench/lora_module_bound.py)
        module = module_bound.measure(paths["policy"]["tiny"], threads, response_tokens,
                                      paths["out"] / "module_bound.json")
        parts = {**module["best"], "generate": out["decode_products_s"]}
        out["module"] = {**module, "parts": parts, "step_s": sum(parts.values())}
    return out


def _lean(argv: list[str]) -> None:
    """`_lean TASK HF_POLICY DATA_DIR TOKENIZER THREADS RESPONSE_TOKENS`: prints the bounds as one JSON line."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, LlamaForCausalLM

    from bench.rl_vs_trl import _gemm_rate

    task, policy, data, tokenizer, threads, response_tokens = argv
    torch.set_num_threads(int(threads))
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(policy, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)

    class Adapted(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear):
            super().__init__()
            self.base, self.on, self.scale = base, True, ALPHA / RANK
            bound = 1 / math.sqrt(base.in_features)
            self.a = torch.nn.Parameter(torch.empty(RANK, base.in_features).uniform_(-bound, bound))
            self.b = torch.nn.Parameter(torch.randn(base.out_features, RANK) * 0.01)

        def forward(self, x):
            y = self.base(x)
            return y + F.linear(F.linear(x, self.a), self.b) * self.scale if self.on else y

    adapters = []
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                adapters.append(Adapted(getattr(parent, n)))
                setattr(parent, n, adapters[-1])
    trained = [p for a in adapters for p in (a.a, a.b)]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.0)
    cfg = model.config
    vocab, h, ffn, layers = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    backbone, head = 2 * layers * (h * 4 * h + 3 * h * ffn), 2 * h * vocab  # forward FLOPs a token (MHA: kv = h)

    def set_adapters(on: bool):
        for a in adapters:
            a.on = on

    if task == "grpo":
        prompt, response = 4, round(float(response_tokens))
        rows = RL_RUN["prompts_per_step"] * RL_RUN["num_generations"]
        length = prompt + response
    else:
        tok = AutoTokenizer.from_pretrained(tokenizer)
        records = [json.loads(line) for line in (Path(data) / "prefs.jsonl").read_text().splitlines()]

        def mean_len(key, extra=0):
            return statistics.fmean(len(tok(r[key], add_special_tokens=False)["input_ids"]) + extra for r in records)

        prompt = round(mean_len("prompt"))
        chosen, rejected = round(mean_len("chosen", 1)), round(mean_len("rejected", 1))  # + the eos
        rows, length = 16, prompt + chosen + rejected  # a pair a row: its prompt once, as aligner packs it
    ids = torch.randint(0, vocab, (rows, length))
    first = prompt - 1  # the first position whose output a loss reads: logits only from there on

    def token_logprobs(tokens):
        hidden = model.model(input_ids=tokens).last_hidden_state[:, first:-1]
        logits = model.lm_head(hidden).float()
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, first + 1:, None]).squeeze(-1)

    @torch.compile(dynamic=False)
    def reference(tokens):
        with torch.no_grad():
            return token_logprobs(tokens)

    if task == "grpo":
        advantages = torch.randn(rows, 1)

        @torch.compile(dynamic=False)
        def loss_of(tokens, ref, adv):
            logprobs = token_logprobs(tokens)
            ratio = torch.exp(logprobs - logprobs.detach())
            policy_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            d = ref - logprobs
            return (policy_loss + RL_RUN["kl_beta"] * (torch.exp(d) - d - 1)).mean()  # every read token counts

        tokens, read = ids.numel(), rows * (length - prompt)
        pass_flops = backbone * tokens + head * read  # a sequence pass, the logits where read
        flops = {"generate": backbone * rows * (length - 1) + head * read, "reference": pass_flops,
                 "train": 2 * pass_flops}
    else:
        @torch.compile(dynamic=False)
        def loss_of(tokens, ref, _adv):
            logprobs = token_logprobs(tokens)
            pi = torch.stack([logprobs[:, :chosen].sum(-1), logprobs[:, chosen:].sum(-1)])
            r = torch.stack([ref[:, :chosen].sum(-1), ref[:, chosen:].sum(-1)])
            return -F.logsigmoid(0.1 * ((pi[0] - r[0]) - (pi[1] - r[1]))).mean()

        advantages, tokens, read = None, ids.numel(), rows * (length - prompt)
        pass_flops = backbone * tokens + head * read
        flops = {"reference": pass_flops, "train": 2 * pass_flops}

    def train_step(ref):
        set_adapters(True)
        loss_of(ids, ref, advantages).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def reference_step():
        set_adapters(False)
        out = reference(ids)
        set_adapters(True)
        return out

    timed_cpu = module_bound.timed_cpu

    ref = reference_step()
    measured = {"reference": timed_cpu(reference_step), "train": timed_cpu(lambda: train_step(ref))}
    if task == "grpo":
        # generation's matrix products at the shapes a KV-cache decoder runs them (the prefill of every prompt,
        # then one [rows, width] product a projection per further token, the head at the last position only):
        # what even an overhead-free decoder spends; the FLOP floor assumes the rate of large products instead
        weights = [a.base.weight for a in adapters]
        inputs = {w.shape[1]: torch.randn(rows * prompt, w.shape[1]) for w in weights}
        head = model.lm_head.weight

        def decode_products():
            for n in [rows * prompt] + [rows] * (response - 1):
                for w in weights:
                    torch.mm(inputs[w.shape[1]][:n], w.t())
                torch.mm(inputs[h][:rows], head.t())

        measured_generate = timed_cpu(decode_products)
    rate = max(_gemm_rate(int(tokens), h, ffn), _gemm_rate(1024, 1024, 1024))
    floor = {k: v / rate for k, v in flops.items()}
    lean = {**measured, **({"generate": floor["generate"]} if "generate" in floor else {})}
    print(json.dumps({"task": task, "tokens": tokens, "gemm_flops_per_s": rate, "floor": floor,
                      "floor_step_s": sum(floor.values()), "lean": lean, "lean_step_s": sum(lean.values()),
                      **({"decode_products_s": measured_generate} if task == "grpo" else {}),
                      "shape": {"prompt": prompt, **({"chosen": chosen, "rejected": rejected} if task == "dpo" else
                                                     {"response": response})},
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


# ---- the run -----------------------------------------------------------------------------------------------
def paired(runs: dict, peer: str, mine: str) -> list[float]:
    """peer's CPU s/step over mine's, round by round (rounds both ran)."""
    return [p["cpu_step_s"] / m["cpu_step_s"] for p, m in zip(runs.get(peer, []), runs.get(mine, []))]


def host() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    versions = subprocess.run([TRL_PYTHON, "-c", "import torch, transformers, trl, peft; print(torch.__version__, "
                               "transformers.__version__, trl.__version__, peft.__version__)"],
                              capture_output=True, text=True).stdout.split()
    import torch

    return {"cpu": model, "cores": os.cpu_count(), "avx512": any(f.startswith("avx512") for f in flags),
            "kernel": platform.release(), "date": datetime.date.today().isoformat(), "commit": commit,
            "aligner_torch": torch.__version__,
            "trl_side": dict(zip(("torch", "transformers", "trl", "peft"), versions))}


def fmt_ratios(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x ({' / '.join(f'{x:.2f}' for x in xs)})" if xs else "n/a"


def report(summary: dict, args, info: dict) -> str:
    flags = " --quick" if args.quick else (f" --repeats {args.repeats}" if args.repeats != 1 else "")
    lines = [f"# LoRA on CPU: aligner against aligner full fine-tuning and TRL + peft "
             f"(`python bench/lora.py{flags}`)", "",
             f"Host: {info['cpu']}, {info['cores']} cores (shared), AVX-512 {'yes' if info['avx512'] else 'no'}, "
             f"kernel {info['kernel']}; {info['date']}, aligner {info['commit']} (torch {info['aligner_torch']}); "
             f"TRL side: " + ", ".join(f"{k} {v}" for k, v in info["trl_side"].items()) + ".",
             f"1 torch thread a process; LoRA rank {RANK}, alpha {ALPHA:g}; tiny model steps {args.warmup + 1}.."
             f"{args.steps}, hidden-512 steps {args.h512_warmup + 1}..{args.h512_steps}; {args.repeats} round(s) "
             f"(hidden-512: {min(args.repeats, args.h512_repeats)}); aligner's GRPO with generation.decode="
             f"{args.decode}. Ratios pair runs of the same round: median (each round).", "",
             "## Step time (CPU s/step)", "",
             "| task | aligner full | aligner LoRA | TRL + peft LoRA | full / LoRA (aligner) | TRL+peft / aligner LoRA "
             "| target | other cores (max) |", "|---|---|---|---|---|---|---|---|"]
    for task, s in summary["tasks"].items():
        if all(v is None for v in s["cpu_step_s"].values()):
            continue  # not timed (--quick's hidden-512 case)
        cpu = {k: (f"{v:.4f}" if v is not None else "-") for k, v in s["cpu_step_s"].items()}
        target = ""
        if "speed_target_met" in s:
            target = f">= {TARGET_SPEED:g}x: {'met' if s['speed_target_met'] else 'not met'}"
        lines.append(f"| {task} | {cpu['aligner_full']} | {cpu['aligner_lora']} | {cpu['trl_peft']} | "
                     f"{fmt_ratios(s['full_over_lora'])} | {fmt_ratios(s['trl_over_lora'])} | {target} | "
                     f"{s['other_cores_max']:.2f} |")
    phases = [f"* {task}, {side.replace('_', ' ')}: " + ", ".join(f"{k} {v:.4f}" for k, v in p.items())
              for task, s in summary["tasks"].items() for side, p in s["phases"].items() if len(p) > 1]
    if phases:
        lines += ["", "Where aligner's step goes (wall s, medians; `train` is the policy's forward, backward and "
                      "optimizer step):", ""] + phases
    lines += ["", "## Peak tensor memory (MiB)", "",
              "Measured: the profiler's peak of live CPU tensor bytes from the model's build on, in a "
              f"{MEMORY_STEPS}-step "
              "run: the largest of steps 2.. (Adam's states exist; aligner full and LoRA see the same batches); "
              "\"whole run\" includes step 1. Plan @run: `aligner plan` at the run's mean tokens per sequence; "
              "plan @max: at data.max_length (256; RL: + max_new_tokens), the planner's worst case.", "",
              "| task | aligner full: measured / plan @run / plan @max "
              "| aligner LoRA: measured / plan @run / plan @max "
              "| LoRA / full: measured, whole run, plan @run | TRL + peft LoRA measured | TRL+peft / aligner LoRA | "
              "target |", "|---|---|---|---|---|---|---|"]
    for task, s in summary["tasks"].items():
        m = s.get("memory")
        if not m:
            continue

        def cell(side):
            x, nan = m.get(side), float("nan")
            plan = x.get("plan", {})
            return f"{x['measured'] / MIB:.0f} / {plan.get('run', nan) / MIB:.0f} / {plan.get('max', nan) / MIB:.0f}"

        target = ""
        if "memory_target_met" in s:
            target = f"<= {TARGET_MEMORY:g}x: {'met' if s['memory_target_met'] else 'not met'}"
        trl = m.get("trl_peft", {}).get("measured")
        peer = f"{trl / MIB:.0f} | {trl / m['aligner_lora']['measured']:.2f}x" if trl else "- | -"
        lines.append(f"| {task} | {cell('aligner_full')} | {cell('aligner_lora')} | {m['lora_over_full']:.3f}x, "
                     f"{m['lora_over_full_run_peak']:.3f}x, {m['lora_over_full_planned']:.3f}x | {peer} | {target} |")
    if "trl_full_over_peft_h512" in summary:
        lines += ["", f"TRL's own ratio on the hidden-512 DPO (measured the same way): TRL + peft LoRA / TRL full "
                      f"(explicit reference copy) = {summary['trl_full_over_peft_h512']:.3f}x."]
    if summary.get("bounds"):
        lines += ["", "## Bounds (tiny model, CPU s/step)", "",
                  "| task | TRL + peft | aligner LoRA | floor | lean bound (parts) | TRL+peft / floor | "
                  "TRL+peft / lean bound | aligner LoRA / lean bound |", "|---|---|---|---|---|---|---|---|"]
        for task, b in summary["bounds"].items():
            s = summary["tasks"][task]["cpu_step_s"]
            parts = " + ".join(f"{k} {v:.4f}" for k, v in b["lean"].items())
            lines.append(f"| {task} | {s['trl_peft']:.4f} | {s['aligner_lora']:.4f} | {b['floor_step_s']:.4f} | "
                         f"{b['lean_step_s']:.4f} ({parts}) | {s['trl_peft'] / b['floor_step_s']:.2f}x | "
                         f"{s['trl_peft'] / b['lean_step_s']:.2f}x | {s['aligner_lora'] / b['lean_step_s']:.2f}x |")
        for task, b in summary["bounds"].items():
            lines += ["", *part_table(task, summary["tasks"][task], b)]
    lines += ["", "## Targets", ""] + [f"* {t}" for t in summary["verdicts"]]
    return "\n".join(lines) + "\n"


def part_table(task: str, s: dict, b: dict) -> list[str]:
    """Where aligner LoRA's step goes against the lean bound, part by part (its phases' medians, wall s; the
    lean parts CPU s, one thread)."""
    phases, lean = s["phases"]["aligner_lora"], b["lean"]
    timed = ("generate", "reference", "train")
    rows = [(p, phases.get(p, 0.0), lean.get(p, 0.0)) for p in timed]
    rows.append(("rest of the step", phases["step"] - sum(phases.get(p, 0.0) for p in timed), 0.0))
    lines = [f"{task}, aligner LoRA's step against the lean bound, by part (s):", "",
             "| part | aligner LoRA | lean bound | aligner - lean |", "|---|---|---|---|"]
    lines += [f"| {p} | {mine:.4f} | {bound:.4f} | {mine - bound:+.4f} |" for p, mine, bound in rows]
    if "decode_products_s" in b:
        lines += ["", f"The lean bound credits generation at its FLOP floor; the same matrix products at the shapes a "
                      f"KV-cache decoder runs them (batch {RL_RUN['prompts_per_step'] * RL_RUN['num_generations']} "
                      f"rows a step) take {b['decode_products_s']:.4f} s here, so a lean step with an overhead-free "
                      f"decoder takes at least {b['lean_step_s'] - lean['generate'] + b['decode_products_s']:.4f} s."]
    m = b.get("module")
    if m:
        trl = s["cpu_step_s"]["trl_peft"]
        lines += ["", "The Megatron actor's bound (bench/lora_module_bound.py): the GPTModel that aligner trains, "
                      "with its adapters and nothing of the trainer around it, on the same batch (CPU s; compiling "
                      f"took {m['compile_wall_s']:.0f} s, outputs within {m['compiled_vs_eager_max_abs']:.1e} of "
                      "eager):", "",
                  "| part | eager | torch.compile | counted |", "|---|---|---|---|"]
        lines += [f"| {part} | {m['eager'][part]:.4f} | {m['compiled'][part]:.4f} | {m['best'][part]:.4f} |"
                  for part in ("reference", "train")]
        lines += [f"| generate (decode-shaped products) | | | {m['parts']['generate']:.4f} |",
                  f"| step | | | {m['step_s']:.4f} |", "",
                  f"TRL + peft's step over it: {trl / m['step_s']:.2f}x; aligner LoRA's step is "
                  f"{s['cpu_step_s']['aligner_lora'] / m['step_s']:.2f}x it."]
    return lines


def summarize(todo: dict, runs: dict, memory: dict, plans: dict) -> dict:
    tasks = {}
    for task, model in (("sft", "tiny"), ("dpo", "tiny"), ("grpo", "tiny"), ("dpo", "h512")):
        key = f"{task}_h512" if model == "h512" else task
        names = {side: f"{side}_{key}" for side in ("trl_peft", "aligner_full", "aligner_lora")}
        if not any(n in todo for n in names.values()):
            continue
        s = {"cpu_step_s": {side: (statistics.median(r["cpu_step_s"] for r in runs[n]) if runs.get(n) else None)
                            for side, n in names.items()},
             "step_s": {side: (statistics.median(r["step_s"] for r in runs[n]) if runs.get(n) else None)
                        for side, n in names.items()},
             "phases": {side: {p: statistics.median(r["phases"][p] for r in runs[n]) for p in runs[n][0]["phases"]}
                        for side, n in names.items() if runs.get(n)},
             "full_over_lora": paired(runs, names["aligner_full"], names["aligner_lora"]),
             "trl_over_lora": paired(runs, names["trl_peft"], names["aligner_lora"]),
             "other_cores_max": max((r["other_cores"] for n in names.values() for r in runs.get(n, [])), default=0.0)}
        if task in ("dpo", "grpo") and model == "tiny" and s["trl_over_lora"]:
            s["speed_target_met"] = statistics.median(s["trl_over_lora"]) >= TARGET_SPEED
        if all(n in memory for n in (names["aligner_full"], names["aligner_lora"])):
            m = {side: {"measured": memory[n]["tensor_peak_bytes"], "run_peak": memory[n]["run_peak_bytes"],
                        "steps": memory[n]["steps"], "peak_in": memory[n].get("peak_in"),
                        "trained_parameters": memory[n].get("trained_parameters"),
                        **({"plan": {k: v["bytes"] for k, v in plans[n].items()}} if n in plans else {})}
                 for side, n in names.items() if n in memory}
            full, lora = m["aligner_full"], m["aligner_lora"]
            m["lora_over_full"] = lora["measured"] / full["measured"]
            m["lora_over_full_per_step"] = [b / a for a, b in zip(full["steps"][1:], lora["steps"][1:]) if a and b]
            m["lora_over_full_run_peak"] = lora["run_peak"] / full["run_peak"]
            m["lora_over_full_planned"] = (lora["plan"]["run"] / full["plan"]["run"]
                                           if "run" in lora.get("plan", {}) else float("nan"))
            # what LoRA removes in fp32: the base's gradients (4 bytes a parameter), Adam's m and v (8) and the
            # reference copy (4); the activations stay. The ratio if it removed exactly that and added nothing:
            m["removable_bytes"] = 16 * full["trained_parameters"]
            m["lora_over_full_if_only_removed"] = 1 - m["removable_bytes"] / full["measured"]
            s["memory"] = m
            if task == "dpo" and model == "h512":
                s["memory_target_met"] = m["lora_over_full"] <= TARGET_MEMORY
        tasks[key] = s
    out = {"tasks": tasks}
    if "trl_full_dpo_h512" in memory and "trl_peft_dpo_h512" in memory:
        out["trl_full_over_peft_h512"] = (memory["trl_peft_dpo_h512"]["tensor_peak_bytes"]
                                          / memory["trl_full_dpo_h512"]["tensor_peak_bytes"])
    return out


def verdicts(summary: dict) -> list[str]:
    out = []
    d = summary["tasks"].get("dpo_h512", {})
    if "memory_target_met" in d:
        m = d["memory"]
        full, lora = m["aligner_full"], m["aligner_lora"]
        out.append(
            f"LoRA DPO's peak <= {TARGET_MEMORY:g}x full DPO's (hidden-512): "
            f"{'met' if d['memory_target_met'] else 'NOT met'}: {lora['measured'] / MIB:.0f} / "
            f"{full['measured'] / MIB:.0f} "
            f"MiB = {m['lora_over_full']:.3f}x measured over the same batches (steps 2..{len(full['steps'])}; step by "
            f"step {' / '.join(f'{x:.3f}' for x in m['lora_over_full_per_step'])}), {m['lora_over_full_planned']:.3f}x "
            f"planned at the run's lengths. Over the whole run, step 1 included: {lora['run_peak'] / MIB:.0f} / "
            f"{full['run_peak'] / MIB:.0f} MiB = {m['lora_over_full_run_peak']:.3f}x (full fine-tuning has no Adam "
            f"state in step 1, so its peak comes later, on another batch than LoRA's when step 1's batch is the "
            f"largest). What LoRA removes is the base's gradients, Adam states and reference copy, "
            f"{m['removable_bytes'] / MIB:.0f} MiB (16 bytes a parameter); the activations stay, so removing exactly "
            f"that would give {m['lora_over_full_if_only_removed']:.3f}x.")
    for task in ("dpo", "grpo"):
        s = summary["tasks"].get(task, {})
        if "speed_target_met" not in s:
            continue
        r = statistics.median(s["trl_over_lora"])
        line = (f"LoRA {task.upper()} >= {TARGET_SPEED:g}x faster than TRL + peft (CPU s/step, tiny model): "
                f"{'met' if s['speed_target_met'] else 'NOT met'}: {r:.2f}x "
                f"({' / '.join(f'{x:.2f}' for x in s['trl_over_lora'])}).")
        b = summary.get("bounds", {}).get(task)
        if b:
            trl, mine = s["cpu_step_s"]["trl_peft"], s["cpu_step_s"]["aligner_lora"]
            reach, floor = trl / b["lean_step_s"], trl / b["floor_step_s"]
            if b["lean_step_s"] < mine:
                line += (f" Bound: a lean compiled LoRA step (bench/lora.py `_lean`) takes {b['lean_step_s']:.4f} "
                         "CPU s "
                         f"here, aligner's {mine / b['lean_step_s']:.2f}x that; a lean step would reach {reach:.2f}x "
                         f"TRL + peft, so the target is "
                         + ("within reach of a lean compiled step, not of aligner's eager megatron step"
                            if reach >= TARGET_SPEED else "out of reach on this CPU even for a lean compiled step")
                         + f"; the matmul floor ({b['floor_step_s']:.4f} s) caps any implementation at {floor:.2f}x.")
            else:
                line += (f" The lean compiled step ({b['lean_step_s']:.4f} CPU s) is no faster than aligner's, so it "
                         f"bounds nothing; the matmul floor ({b['floor_step_s']:.4f} s) caps any implementation at "
                         f"{floor:.2f}x TRL + peft.")
        m = (b or {}).get("module")
        if m:
            reach = s["cpu_step_s"]["trl_peft"] / m["step_s"]
            line += (f" The Megatron actor's own bound (its GPTModel's reference and train passes alone, the faster "
                     f"of eager and torch.compile, plus the decode-shaped products) is {m['step_s']:.4f} s, "
                     f"{reach:.2f}x TRL + peft: "
                     + ("out of reach for any step built on the Megatron GPTModel on this CPU, before any of "
                        "aligner's trainer runs" if reach < TARGET_SPEED else
                        "the model allows it; what aligner runs around the model's passes (its decoder, the "
                        "step's glue) is what is slower") + ".")
        out.append(line)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_memory", "_lean", "_plan"):
        {"_memory": _memory, "_lean": _lean, "_plan": _plan}[sys.argv[1]](sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 round of the tiny cases (10 steps), memory of the hidden-512 DPO pair only")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    parser.add_argument("--h512-steps", type=int, default=4)
    parser.add_argument("--h512-warmup", type=int, default=1)
    parser.add_argument("--h512-repeats", type=int, default=1, help="rounds that also time the hidden-512 cases")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the timed cases, interleaved")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--bounds", choices=["auto", "always", "never"], default="auto",
                        help="the floor and lean bound of DPO and GRPO: auto = where the speed target is missed")
    parser.add_argument("--decode", choices=["auto", "lean", "compiled"], default="auto",
                        help="aligner's generation.decode in the GRPO runs (compiled: Inductor, needs g++)")
    parser.add_argument("--out", default="runs/bench-lora")
    parser.add_argument("--md", help="also write the report (markdown) here")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps, args.warmup, args.h512_repeats = 1, 10, 4, 0
    if not Path(TRL_PYTHON).exists():
        sys.exit(f"no TRL interpreter at {TRL_PYTHON}; create the venv (bench/preference_vs_trl.py's doc) or set "
                 "ALIGNER_TRL_PYTHON")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    paths = {**prepare_all(out, args.threads), "decode": args.decode}
    todo = {k: v for k, v in cases().items() if not args.only or k in args.only}
    runs: dict[str, list[dict]] = {}
    for attempt in range(args.repeats):
        for name, case in todo.items():
            if name in MEMORY_ONLY or (case[1] == "h512" and attempt >= args.h512_repeats):
                continue
            steps, warmup = (args.h512_steps, args.h512_warmup) if case[1] == "h512" else (args.steps, args.warmup)
            runner = run_trl if case[2] == "trl" else run_aligner
            r = runner(name, case, paths, out, steps, warmup, args.threads, attempt)
            runs.setdefault(name, []).append(r)
            print(f"[bench] {name} round {attempt}: {r['step_s']:.4f} s/step, {r['cpu_step_s']:.4f} CPU s/step, "
                  f"other cores {r['other_cores']:.2f}", file=sys.stderr, flush=True)
    memory, requests = {}, {}
    if not args.no_memory:
        for name, case in todo.items():
            if args.quick and name not in QUICK_MEMORY:
                continue
            measure = memory_trl if case[2] == "trl" else memory_aligner
            memory[name] = measure(name, case, paths, out, args.threads)
            if case[2] == "aligner":
                tokens = statistics.median(r["tokens_per_seq"] for r in runs[name]) if runs.get(name) else None
                requests[name] = plan_requests(case, paths, out, args.threads, tokens or tokens_guess(name, runs))
            print(f"[bench] {name} memory: {memory[name]['tensor_peak_bytes'] / MIB:.1f} MiB", file=sys.stderr,
                  flush=True)
    plans = planned(requests, args.threads) if requests else {}
    summary = summarize(todo, runs, memory, plans)
    if args.bounds != "never":
        summary["bounds"] = {}
        for task in ("dpo", "grpo"):
            s = summary["tasks"].get(task)
            if not s or "speed_target_met" not in s or (s["speed_target_met"] and args.bounds == "auto"):
                continue
            response = 16.0
            if task == "grpo":
                response = statistics.median(r["tokens_per_seq"] for r in runs[f"aligner_lora_{task}"]) - 4
            summary["bounds"][task] = bounds(task, paths, args.threads, response)
    summary["verdicts"] = verdicts(summary)
    info = host()
    summary["wall_s"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps({"args": vars(args), "host": info, "summary": summary,
                                                  "runs": runs, "memory": memory, "plans": plans}, indent=1))
    text = report(summary, args, info) + f"\nThe run took {summary['wall_s'] / 60:.1f} minutes.\n"
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    print(f"all numbers: {out / 'results.json'}")


def tokens_guess(name: str, runs: dict) -> float | None:
    """A case timed under another name's runs (the hidden-512 cases in --quick): the tiny model's same task."""
    twin = name.replace("_h512", "")
    return statistics.median(r["tokens_per_seq"] for r in runs[twin]) if runs.get(twin) else None


if __name__ == "__main__":
    main()
