"""aligner's online RL (`aligner train grpo`, advantage grpo and rloo) against TRL's GRPOTrainer and
RLOOTrainer, on the identical tiny configuration, in one run: the TRL peer baseline's artifacts
(tokenizer, Llama 4L/128h/4 heads/ffn 512/vocab 512 policy, arith.jsonl: prompts "12+7=" with their
answer), 8 prompts x 4 samples = 32 per step, 16 new tokens, temperature 1.0, top_p 1.0, top_k 0, KL
to a reference model with beta 0.04, clip epsilon 0.2, one optimizer step per batch, AdamW lr 1e-5
constant, no weight decay, grad-clip 1.0, seed 1234, fp32, the baseline's reward (exact integer match
against the answer: bench/rl_reward.py), 30 steps of which the first 5 are not timed. Prints median
seconds per step and TRL's s/step over ours, against the issue's target of 3x.
PPO (`aligner train ppo` with its embedded critic/reward service against TRL 1.12.0's PPOTrainer, 32
prompts x 1 sample, the baseline's seq-cls reward model as reward model and critic/value init) is
bench/rl_ppo.py: its configuration, what still differs, its step breakdown and the service's overlap.

    python bench/rl_vs_trl.py [--steps 30] [--threads 1] [--repeats 1] [--only CASE ...] [--out runs/bench-rl]

Cases: trl_grpo aligner_grpo trl_rloo aligner_rloo aligner_rloo_kl_reward trl_ppo trl_ppo_nogc aligner_ppo
logits_long_prompts.

`logits_long_prompts` (aligner alone, no TRL: bench/rl_logits_positions.py) is the step's two log-prob
passes on this policy's shapes with 256-token prompts (16-token responses, 32 samples, one packed
micro-batch), the output layer computed at the response positions only (what every aligner pass does)
against the full logits, in the same process: the logits' MiB, the pass's peak of tensor memory and its
CPU seconds, after / before; with the policy's vocabulary (512) and with 8192. Measured 2026-11-28 (a
shared, busy machine; CPU seconds, median of 5), 512 of 8672 positions read:

| vocab | pass | logits MiB | peak tensor MiB | CPU s |
|---|---|---|---|---|
| 512 | log-probs (forward) | 16.9 -> 1.0 (0.059x) | 87.9 -> 87.9 (1.00x: the MLP's peak) | 0.711 -> 0.644 (0.91x) |
| 512 | policy loss (fwd + bwd) | 16.9 -> 1.0 (0.059x) | 487 -> 415 (0.85x) | 1.389 -> 1.382 (0.99x) |
| 8192 | log-probs (forward) | 271 -> 16 (0.059x) | 816 -> 88 (0.11x) | 1.465 -> 0.597 (0.41x) |
| 8192 | policy loss (fwd + bwd) | 271 -> 16 (0.059x) | 1759 -> 475 (0.27x) | 5.070 -> 1.588 (0.31x) |

Method, environment and measurements as in bench/preference_vs_trl.py (whose helpers this uses): TRL
runs in its own virtual environment (ALIGNER_TRL_PYTHON, default /tmp/trl-venv/bin/python) driving the
peer baseline's own script (bench_grpo.py, with --rloo for RLOOTrainer; ALIGNER_TRL_BENCH_DIR) with its
exact configuration; aligner loads the same HF weights through `aligner convert hf-to-mcore` and
reads the baseline's arith.jsonl as it is ({"prompt": "12+7=", "answer": "19"}: the same plain-text
prompts TRL's GRPOTrainer gets, no chat template on either side; "answer" reaches the reward function
as a field). Step time is wall time per step (median over the timed steps); CPU s/step is the process's
CPU time per step (mean over the timed steps), the ratio's basis with 1 thread (the default); "other
cores" is other processes' average core use during a run (over ~0.3 the wall times are contaminated).
aligner scores in worker processes: one here (`reward.workers=1`; TRL calls its reward function in the
trainer's process), and its CPU time is that of its whole process tree.
`--repeats N` runs every case N times in interleaved rounds; a ratio pairs each attempt with TRL's
attempt of the same round, and the table gives the median of those paired ratios and each of them.
Generated tokens count each response up to and including its eos, on both sides.

Where the two sides still differ (neither changes the work a step does, except where said):
  * GRPO: none in the algorithm (TRL 1.16: loss_type="dapo" = token_mean over the step's tokens,
    scale_rewards="group" = grpo advantages, k3 KL in the loss). Both skip the old-log-prob forward
    (one update per rollout: the update's own forward gives them).
  * RLOO: TRL's RLOOTrainer puts the KL into the reward (k1, summed over a sample's tokens), takes a
    sequence-level ratio exp(sum of token log-ratios), averages the loss over samples, and so runs an
    old-log-prob forward every step. `aligner_rloo` is the issue's configuration (GRPO's k3 KL in the
    loss, token ratio, token_mean: no old-log-prob forward, one policy forward less than TRL);
    `aligner_rloo_kl_reward` puts k1 KL into the reward as TRL does (aligner subtracts the masked-mean
    KL, TRL the sum: same work), which brings the old-log-prob forward back: the like-for-like work.
  * Sampling order of prompts: each side shuffles arith.jsonl with seed 1234 in its own way; every
    prompt is 4 tokens, and the random-init policy almost never samples eos (responses ~16 tokens),
    so the shapes match step for step.

Measured (2026-11-26, a quiet machine, --repeats 2, 1 thread; TRL's own step varied 0.165-0.191 s between
rounds):

| case | CPU s/step | TRL / aligner (per round) |
|---|---|---|
| trl_grpo | 0.178 | |
| aligner_grpo | 0.175 | 1.02x (1.10 / 0.94) |
| trl_rloo | 0.208 | |
| aligner_rloo | 0.166 | 1.26x (1.33 / 1.18) |

The floor was 0.039 s. The lean bound (bench/rl_lean_bound.py) was 0.076 s: TRL over it is 2.35x for GRPO
and 2.73x for RLOO. So the 3x target is out of reach on this CPU even for a lean compiled step. PPO: see
bench/rl_ppo.py (1.9x).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import rl_ppo  # noqa: E402
from bench.preference_vs_trl import (OFFLINE, TRL_BENCH_DIR, TRL_PYTHON, _busy_seconds, _cpu_seconds,  # noqa: E402
                                     prepare, timed)

TARGET = 3.0  # the target: TRL's time per step over aligner's
RUN = {"prompts_per_step": 8, "num_generations": 4, "max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0,
       "top_k": 0, "kl_beta": 0.04, "clip_eps": 0.2, "lr": 1e-5, "seed": 1234}  # the baseline's common.RUN
LONG_PROMPTS = "logits_long_prompts"  # the output layer at the response positions only (bench/rl_logits_positions.py)
PHASES = ("generate", "score", "score_wait", "logprobs", "reference", "train", "refit")  # aligner's timing/<phase>_s


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _tree_cpu_seconds(pid: int, cmdlines: dict | None = None, service: set | None = None) -> tuple[float | None, float]:
    """(CPU seconds of `pid` and its live descendants, those of PPO's embedded critic service among them).
    aligner's reward workers and PPO's service are processes of their own: the service is started with
    start_new_session, a session of its own, but it is still a descendant. `cmdlines` caches each pid's
    command line (and so records every process the walk reached); `service` collects the service's pids."""
    cmdlines = {} if cmdlines is None else cmdlines
    service = set() if service is None else service
    total, service_cpu, todo = None, 0.0, [(pid, False)]
    while todo:
        p, under = todo.pop()
        cpu = _cpu_seconds(p)
        if cpu is None:
            continue
        if p not in cmdlines:
            cmdlines[p] = _cmdline(p)
        under = under or rl_ppo.is_service(cmdlines[p])
        total = (total or 0.0) + cpu
        if under:
            service_cpu += cpu
            service.add(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [(int(c), under) for c in f.read().split()]
        except OSError:
            pass
    return total, service_cpu


def timed_tree(cmd: list[str], env: dict, cwd: Path, log: Path, metrics: Path) -> dict:
    """preference_vs_trl.timed for a command with child processes: the CPU seconds of the whole process
    tree (`step_cpu`), and of PPO's service in it (`step_service_cpu`), at the moment each line was
    appended to `metrics` (read only when the file grew); `cmdlines`: every process the walk reached, and
    `service_pids`: those of the service."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, start = _busy_seconds(), time.perf_counter()
    step_cpu, step_service_cpu, size, cmdlines, service_pids = [], [], 0, {}, set()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if metrics.exists() and metrics.stat().st_size != size:
                with open(metrics, "rb") as f:
                    data = f.read()
                size, lines = len(data), data.count(b"\n")
                cpu, service = _tree_cpu_seconds(proc.pid, cmdlines, service_pids)
                if cpu is not None:
                    step_service_cpu += [service] * (lines - len(step_cpu))
                    step_cpu += [cpu] * (lines - len(step_cpu))
            time.sleep(0.002)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}; see {log}")
    return {"wall_s": wall, "other_cores": max(0.0, (_busy_seconds() - busy - own) / wall), "step_cpu": step_cpu,
            "step_service_cpu": step_service_cpu, "cmdlines": cmdlines, "service_pids": sorted(service_pids)}


def run_trl(name: str, paths: dict, out: Path, steps: int, warmup: int, threads: int, attempt: int,
            max_new_tokens: int | None = None) -> dict:
    """The baseline's bench_grpo.py; `max_new_tokens` other than its 16 runs it through bench/trl_device.py,
    which sets that response length."""
    algorithm = name.removeprefix("trl_")
    results = out / "trl_results" / str(attempt)
    env = {**os.environ, **OFFLINE, "TRL_BENCH_HOME": str(paths["trl_home"]), "TRL_BENCH_RESULTS": str(results),
           "BENCH_STEPS": str(steps), "BENCH_WARMUP": str(warmup), "BENCH_THREADS": str(threads),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    script = ["bench_grpo.py"]
    if max_new_tokens is not None:
        env["TRL_BENCH_MAX_NEW_TOKENS"] = str(max_new_tokens)
        script.insert(0, str(REPO / "bench" / "trl_device.py"))
    cmd = [TRL_PYTHON, *script, *(["--rloo"] if algorithm == "rloo" else [])]
    load = timed(cmd, env, TRL_BENCH_DIR, out / f"{name}.{attempt}.log")
    del load["step_cpu"]
    r = json.loads((results / f"{algorithm}.json").read_text())
    timed_steps = r["per_step"][warmup:]
    rewards = [log["reward"] for log in r["logs"] if "reward" in log]
    return {"step_s": r["median_step_s"], "min_step_s": r["min_step_s"],
            "cpu_step_s": statistics.fmean(s["cpu_s"] for s in timed_steps),
            "generated_tokens_per_step": r["gen_tokens_per_step"],
            "phases": {"generate": r["median_gen_s_per_step"],
                       "other": statistics.median(s["step_s"] - s["gen_time"] for s in timed_steps)},
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "trl_config": r.get("config"), **load}


def grpo_overrides(paths: dict, out: Path, run_dir: Path, steps: int, threads: int) -> list[str]:
    n = RUN["prompts_per_step"] * RUN["num_generations"]
    return [f"run_dir={run_dir}", f"tokenizer.path={paths['art'] / 'tokenizer'}",
            f"model.pretrained={out / 'policy_mcore'}", f"data.train_path={paths['art'] / 'data' / 'arith.jsonl'}",
            f"trainer.max_steps={steps}", f"trainer.global_batch_size={n}", f"trainer.micro_batch_size={n}",
            f"trainer.seed={RUN['seed']}", "trainer.save_last=false", "trainer.val_interval=0",
            f"algorithm.prompts_per_step={RUN['prompts_per_step']}",
            f"algorithm.num_generations={RUN['num_generations']}", f"algorithm.kl.coef={RUN['kl_beta']}",
            f"algorithm.clip_low={RUN['clip_eps']}", "algorithm.ppo_epochs=1",
            f"sampling.max_new_tokens={RUN['max_new_tokens']}", f"sampling.temperature={RUN['temperature']}",
            f"sampling.top_p={RUN['top_p']}", f"sampling.top_k={RUN['top_k']}",
            f"optim.lr={RUN['lr']}", "optim.min_lr=1e-6", "optim.scheduler=constant", "optim.warmup_steps=0",
            "optim.weight_decay=0.0", "optim.adam_beta1=0.9", "optim.adam_beta2=0.999", "optim.adam_eps=1e-8",
            "optim.clip_grad=1.0", "reward.functions=[bench.rl_reward:arith]", "reward.workers=1",
            "logging.tensorboard=false",
            "logging.progress=false", f"launcher.threads_per_rank={threads}"]


def run_aligner(name: str, algorithm: str, extra: list[str], paths: dict, out: Path, steps: int, warmup: int,
                threads: int, attempt: int) -> dict:
    """`aligner train grpo` (GRPO, RLOO) or `aligner train ppo` (with its service) on the baseline's
    configuration plus `extra`."""
    run_dir = out / f"{name}.{attempt}"
    ppo = algorithm == "ppo"
    n = rl_ppo.RUN["prompts_per_step"] if ppo else RUN["prompts_per_step"] * RUN["num_generations"]
    overrides = (rl_ppo.overrides if ppo else grpo_overrides)(paths, out, run_dir, steps, threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if run_dir.exists():
        shutil.rmtree(run_dir)
    load = timed_tree([sys.executable, "-m", "aligner.cli", "train", "ppo" if ppo else "grpo", *overrides, *extra],
                      env, REPO, out / f"{name}.{attempt}.log", run_dir / "metrics.jsonl")
    cpu, service_cpu, cmdlines = load.pop("step_cpu"), load.pop("step_service_cpu"), load.pop("cmdlines")
    service_pids = load.pop("service_pids")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at = [i for i, m in enumerate(lines) if "timing/step_s" in m]  # a step's line (not a validation's)
    metrics = [lines[i] for i in at][warmup:]
    step = [m["timing/step_s"] for m in metrics]
    if ppo:
        phases = rl_ppo.phases(metrics)
    else:
        phases = {p: statistics.median(m[f"timing/{p}_s"] for m in metrics)
                  for p in PHASES if all(f"timing/{p}_s" in m for m in metrics)}
        # the rest of a step: its time less the phases it spends in sequence (`score` runs beside them)
        phases["other"] = statistics.median(m["timing/step_s"] - sum(m.get(f"timing/{p}_s", 0.0) for p in PHASES
                                                                     if p != "score") for m in metrics)

    def per_step(series: list[float]) -> float:
        return (series[at[steps - 1]] - series[at[warmup - 1]]) / (steps - warmup)

    result = {"step_s": statistics.median(step), "min_step_s": min(step), "cpu_step_s": per_step(cpu),
              "generated_tokens_per_step": statistics.fmean(m["response_length/mean"] for m in metrics) * n,
              "generated_tokens_per_s": statistics.median(m["throughput/generated_tokens_per_s"] for m in metrics),
              "phases": phases, "reward_mean": statistics.fmean(m["reward/mean"] for m in metrics),
              "processes": len(cmdlines), **load}
    if ppo:
        if not service_pids:
            sys.exit(f"{name}: the process-tree walk never reached the critic service "
                     f"({' '.join(rl_ppo.SERVICE_COMMAND)}), so its CPU time would be missing; processes seen: "
                     f"{sorted(cmdlines)}")
        result.update({"service_cpu_step_s": per_step(service_cpu), "overlap": rl_ppo.overlap(metrics),
                       "service_processes": len(service_pids)})
    return result


def _gemm_rate(m: int, k: int, n: int, reps: int = 50) -> float:
    """FLOP/s of torch's fp32 [m, k] @ [k, n] on this machine now (best of 5 timed batches of `reps`)."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(5):
        a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n * reps / best


def matmul_floor(art: Path, threads: int, prompt_tokens: int, response_tokens: float) -> dict:
    """The least time a step's work can take on this machine, measured in the same run: the dense matmul
    FLOPs every implementation of the configuration must spend (generating the responses, one reference
    forward for the KL, the policy's forward and backward) at the best GEMM rate this core reaches (the
    step's MLP shape or a large square product). Attention scores, norms, softmax, sampling, the optimizer
    and all overheads are left out, so no implementation can step faster than this, and TRL's step time
    over it bounds the ratio any implementation can reach."""
    import torch

    torch.set_num_threads(threads)
    cfg = json.loads((art / "policy" / "config.json").read_text())
    h, ffn, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * h // cfg["num_attention_heads"]
    backbone = layers * (h * (2 * h + 2 * kv) + 3 * h * ffn)
    per_token = 2 * (backbone + h * vocab)  # forward FLOPs of one token
    per_token_scalar = 2 * (backbone + h)  # of a value or reward model (a 1-output head)
    n = RUN["prompts_per_step"] * RUN["num_generations"]
    tokens = n * (prompt_tokens + response_tokens)  # one sequence pass over the step's samples
    # generation: every prompt token once (prefill) and every response token but the last (decode);
    # reference: one forward; policy: forward + backward (2x the forward's FLOPs)
    flops = {"generate": per_token * n * (prompt_tokens + response_tokens - 1), "reference": per_token * tokens,
             "train": 3 * per_token * tokens}
    rate = max(_gemm_rate(int(tokens), h, ffn), _gemm_rate(1024, 1024, 1024))  # the step's MLP shape, or a big one
    samples = rl_ppo.RUN["prompts_per_step"] * rl_ppo.RUN["num_generations"]
    ppo = rl_ppo.floor_flops(per_token, per_token_scalar, samples, prompt_tokens, response_tokens)
    return {"gemm_flops_per_s": rate, "flops": flops, "seconds": {k: v / rate for k, v in flops.items()},
            "step_s": sum(flops.values()) / rate,
            "ppo": {"flops": ppo, "seconds": {k: v / rate for k, v in ppo.items()}, "step_s": sum(ppo.values()) / rate}}


def lean_bound(art: Path, threads: int, prompt_tokens: float, response_tokens: float, floor: dict,
               ppo: bool = False) -> dict:
    """bench/rl_lean_bound.py in a fresh process: a compiled, framework-free GRPO train step and reference
    forward on the step's shapes, plus generation at its matmul floor; CPU s/step. With `ppo` also the
    value model's forward and training step, and PPO's bound (`ppo_step_s`)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, str(REPO / "bench" / "rl_lean_bound.py"), "--policy", str(art / "policy"),
           "--samples", str(RUN["prompts_per_step"] * RUN["num_generations"]), "--threads", str(threads),
           "--prompt-tokens", str(round(prompt_tokens)), "--response-tokens", str(round(response_tokens)),
           *(["--value", str(art / "reward")] if ppo else [])]
    r = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    r["generate_floor_s"] = floor["seconds"]["generate"]
    r["step_s"] = r["train_s"] + r["reference_s"] + r["generate_floor_s"]
    if ppo:
        r["ppo_step_s"] = (r["train_s"] + r["reference_s"] + 2 * r["value_forward_s"] + r["value_train_s"]
                           + floor["ppo"]["seconds"]["generate"])
    return r


def prompt_tokens(art: Path) -> float:
    """Mean prompt length in tokens of the benchmark's prompts, as aligner tokenizes them."""
    from aligner.data.prompts import load_prompt_dataset
    from aligner.data.tokenizer import load_tokenizer

    prompts = load_prompt_dataset(art / "data" / "arith.jsonl", load_tokenizer(art / "tokenizer"), max_length=256)
    return statistics.fmean(len(p.ids) for p in prompts)


def cases() -> dict:
    grpo = ["algorithm.kl.estimator=k3", "algorithm.kl.mode=loss", "algorithm.aggregation=token_mean"]
    return {  # name -> (algorithm, what it is, aligner overrides or None for TRL)
        "trl_grpo": ("grpo", "peer: GRPOTrainer", None),
        "aligner_grpo": ("grpo", "like-for-like", ["algorithm.advantage=grpo", *grpo]),
        "trl_rloo": ("rloo", "peer: RLOOTrainer", None),
        "aligner_rloo": ("rloo", "issue config: k3 KL in the loss (TRL: in the reward, +1 forward)",
                         ["algorithm.advantage=rloo", *grpo]),
        "aligner_rloo_kl_reward": ("rloo", "like-for-like work: k1 KL in the reward, as TRL",
                                   ["algorithm.advantage=rloo", "algorithm.kl.estimator=k1", "algorithm.kl.mode=reward",
                                    "algorithm.aggregation=token_mean"]),
        # PPO (bench/rl_ppo.py): aligner's overrides are rl_ppo.overrides
        "trl_ppo": ("ppo", "peer: PPOTrainer (trl 1.12.0)", None),
        "trl_ppo_nogc": ("ppo", "peer diagnostic: gc.collect patched out", None),
        "aligner_ppo": ("ppo", "like-for-like, embedded critic service", []),
    }


def summarize(todo: dict, runs: dict) -> dict:
    """Medians over attempts and the paired ratios TRL / aligner of each aligner case."""
    out = {}
    for name, (algorithm, what, _) in todo.items():
        mine, peer = runs[name], runs.get(f"trl_{algorithm}", [])
        s = {"algorithm": algorithm, "configuration": what,
             **{k: statistics.median(r[k] for r in mine)
                for k in ("step_s", "cpu_step_s", "generated_tokens_per_step")},
             "phases": {p: statistics.median(r["phases"][p] for r in mine) for p in mine[0]["phases"]},
             "other_cores_max": max(r["other_cores"] for r in mine)}
        if "overlap" in mine[0]:
            s["service_cpu_step_s"] = statistics.median(r["service_cpu_step_s"] for r in mine)
            s["overlap"] = {part: ({k: statistics.median(r["overlap"][part][k] for r in mine) for k in value}
                                   if isinstance(value, dict) else statistics.median(r["overlap"][part] for r in mine))
                            for part, value in mine[0]["overlap"].items()}
        nogc = runs.get(f"trl_{algorithm}_nogc", [])
        if not name.startswith("trl_") and nogc:
            s["ratio_cpu_nogc_per_round"] = [p["cpu_step_s"] / r["cpu_step_s"] for p, r in zip(nogc, mine)]
            s["ratio_cpu_nogc"] = statistics.median(s["ratio_cpu_nogc_per_round"])
        if not name.startswith("trl_") and peer:
            s["ratio_cpu_per_round"] = [p["cpu_step_s"] / r["cpu_step_s"] for p, r in zip(peer, mine)]
            s["ratio_wall_per_round"] = [p["step_s"] / r["step_s"] for p, r in zip(peer, mine)]
            s["ratio_cpu"] = statistics.median(s["ratio_cpu_per_round"])
            s["ratio_wall"] = statistics.median(s["ratio_wall_per_round"])
            s["target_met"] = s["ratio_cpu"] >= TARGET
            s["target_cpu_step_s"] = statistics.median(p["cpu_step_s"] for p in peer) / TARGET
        out[name] = s
    return out


def report(summary: dict, args) -> None:
    print(f"\nCPU, fp32, {args.threads} torch thread(s) per run, {RUN['prompts_per_step']} prompts x "
          f"{RUN['num_generations']} samples (PPO: {rl_ppo.RUN['prompts_per_step']} x "
          f"{rl_ppo.RUN['num_generations']}), {RUN['max_new_tokens']} new tokens per step, steps "
          f"{args.warmup + 1}..{args.steps}, {args.repeats} attempt(s) per run: medians over attempts; a ratio "
          f"pairs each attempt with TRL's attempt of the same round; target: TRL / aligner >= {TARGET:g}x\n")
    print("| algorithm | run | configuration | s/step | CPU s/step | gen tokens/step | TRL / this (CPU s/step) | "
          f"per round | TRL / this (wall) | >= {TARGET:g}x? | other cores (max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        if "ratio_cpu" in s:
            ratio, wall = f"{s['ratio_cpu']:.2f}x", f"{s['ratio_wall']:.2f}x"
            rounds = " / ".join(f"{x:.2f}" for x in s["ratio_cpu_per_round"])
            verdict = ("yes" if s["target_met"] else f"no: {TARGET / s['ratio_cpu']:.2f}x short "
                       f"(needs <= {s['target_cpu_step_s']:.4f} CPU s/step)")
        else:
            ratio = rounds = wall = verdict = "n/a" if not name.startswith("trl_") else ""
        print(f"| {s['algorithm']} | {name} | {s['configuration']} | {s['step_s']:.4f} | {s['cpu_step_s']:.4f} | "
              f"{s['generated_tokens_per_step']:.0f} | {ratio} | {rounds} | {wall} | {verdict} | "
              f"{s['other_cores_max']:.2f} |")
    rows = {name: s for name, s in summary.items() if s["algorithm"] != "ppo"}
    if rows:
        print("\nWhere a step's time goes (seconds, median over the timed steps, then over attempts): aligner's "
              "`score` runs in its worker process beside logprobs/reference, `score wait` is what the step waited for "
              "it, other = the step less the phases it spends in sequence; TRL's harness times only generate, so its "
              "other is all the rest (reward, reference and policy forwards, backward, optimizer)\n")
        print("| algorithm | run | step | generate | score | score wait | logprobs | reference | train | refit | "
              "other |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, s in rows.items():
            cells = [f"{s['phases'][p]:.4f}" if p in s["phases"] else "" for p in (*PHASES, "other")]
            print(f"| {s['algorithm']} | {name} | {s['step_s']:.4f} | {' | '.join(cells)} |")
    rl_ppo.report(summary)


def _print_trl_over(bound_s: float, summary: dict, ppo: bool) -> None:
    """TRL's CPU s/step over `bound_s` for each TRL case of the GRPO family (or of PPO)."""
    for name, s in summary.items():
        if name.startswith("trl_") and (s["algorithm"] == "ppo") == ppo:
            best = s["cpu_step_s"] / bound_s
            print(f"  {name}: {s['cpu_step_s']:.4f} / {bound_s:.4f} = {best:.2f}x "
                  f"({'above' if best >= TARGET else 'below'} the {TARGET:g}x target)")


def report_floor(floor: dict, summary: dict) -> None:
    sec = floor["seconds"]
    print(f"\nThe floor (matmul_floor): this core's best GEMM rate, measured now: "
          f"{floor['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s; a step's unavoidable matmuls at that rate take "
          f"generate {sec['generate']:.4f} + reference {sec['reference']:.4f} + train {sec['train']:.4f} = "
          f"{floor['step_s']:.4f} s, so no implementation reaches more than TRL / floor:")
    _print_trl_over(floor["step_s"], summary, ppo=False)
    bound = floor.get("lean_bound")
    if bound and any(s["algorithm"] != "ppo" for s in summary.values()):
        print(f"The lean bound (bench/rl_lean_bound.py, {bound['threads']} thread(s), CPU s): the baseline's HF "
              f"policy compiled with torch.compile, no framework: train {bound['train_s']:.4f} "
              f"({bound['train_s'] / sec['train']:.2f}x its floor) + reference {bound['reference_s']:.4f} "
              f"({bound['reference_s'] / sec['reference']:.2f}x) + "
              f"generate at its floor {bound['generate_floor_s']:.4f} = {bound['step_s']:.4f} s, so TRL / lean bound:")
        _print_trl_over(bound["step_s"], summary, ppo=False)
    if any(s["algorithm"] == "ppo" for s in summary.values()):
        ppo = floor["ppo"]
        print(f"PPO's floor (rl_ppo.floor_flops: + a value and a reward forward, the value model's forward and "
              f"backward): {' + '.join(f'{k} {v:.4f}' for k, v in ppo['seconds'].items())} = {ppo['step_s']:.4f} s")
        _print_trl_over(ppo["step_s"], summary, ppo=True)
        if bound and "ppo_step_s" in bound:
            print(f"PPO's lean bound: train {bound['train_s']:.4f} + reference {bound['reference_s']:.4f} + 2 x value "
                  f"forward {bound['value_forward_s']:.4f} + value train {bound['value_train_s']:.4f} + generate at "
                  f"its floor {ppo['seconds']['generate']:.4f} = {bound['ppo_step_s']:.4f} s")
            _print_trl_over(bound["ppo_step_s"], summary, ppo=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each (single-process) run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per case, interleaved in rounds")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--out", default="runs/bench-rl")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        sys.exit(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    todo = {k: v for k, v in cases().items() if not args.only or k in args.only}
    if todo:
        compare(args, out, todo)
    if not args.only or LONG_PROMPTS in args.only:
        long_prompts(args.threads, out)


def long_prompts(threads: int, out: Path) -> None:
    """The `logits_long_prompts` case: bench/rl_logits_positions.py in a fresh process per vocabulary, the
    policy's (512) and a larger one (8192, where the output layer weighs more); their tables, and their
    numbers in <out>/logits_long_prompts.json."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    results = []
    for vocab in (512, 8192):
        cmd = [sys.executable, str(REPO / "bench" / "rl_logits_positions.py"), "--prompt-tokens", "256",
               "--vocab", str(vocab), "--threads", str(threads), "--json"]
        lines = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()
        results.append(json.loads(lines[-1]))
        print("\n".join(lines[:-1]))
    (out / f"{LONG_PROMPTS}.json").write_text(json.dumps(results, indent=1))


def compare(args, out: Path, todo: dict) -> None:
    """The cases against TRL: runs, summary, report and the floors."""
    if not Path(TRL_PYTHON).exists():
        sys.exit(f"no TRL interpreter at {TRL_PYTHON}; create the venv (see bench/preference_vs_trl.py's doc) "
                 "or set ALIGNER_TRL_PYTHON")
    if any(k.startswith("trl_ppo") for k in todo) and (why := rl_ppo.check_installed()):
        sys.exit(why)
    paths = prepare(out, args.threads)
    runs: dict[str, list[dict]] = {name: [] for name in todo}
    for attempt in range(args.repeats):
        for name, (algorithm, _, extra) in todo.items():
            if extra is None:
                runner = rl_ppo.run_trl if algorithm == "ppo" else run_trl
                r = runner(name, paths, out, args.steps, args.warmup, args.threads, attempt)
            else:
                r = run_aligner(name, algorithm, extra, paths, out, args.steps, args.warmup, args.threads, attempt)
            print(f"[bench] {name} attempt {attempt}: {r['step_s']:.4f} s/step, {r['cpu_step_s']:.4f} CPU s/step, "
                  f"{r['generated_tokens_per_step']:.0f} generated tokens/step, other cores {r['other_cores']:.2f}",
                  file=sys.stderr, flush=True)
            runs[name].append(r)
    summary = summarize(todo, runs)
    response_tokens = (statistics.median(r["generated_tokens_per_step"] for name in runs for r in runs[name])
                       / (RUN["prompts_per_step"] * RUN["num_generations"]))
    prompt_length = prompt_tokens(paths["art"])
    floor = matmul_floor(paths["art"], args.threads, prompt_length, response_tokens)
    floor["lean_bound"] = lean_bound(paths["art"], args.threads, prompt_length, response_tokens, floor,
                                     ppo=any(s["algorithm"] == "ppo" for s in summary.values()))
    (out / "results.json").write_text(json.dumps({"args": vars(args), "run": RUN, "target": TARGET, "floor": floor,
                                                  "cases": {k: list(v[:2]) + [v[2]] for k, v in todo.items()},
                                                  "summary": summary, "results": runs}, indent=1))
    report(summary, args)
    report_floor(floor, summary)
    print(f"\nall numbers: {out / 'results.json'}")


if __name__ == "__main__":
    main()
