"""aligner DPO and reward-model training against TRL's DPOTrainer and RewardTrainer, on the identical
tiny configuration, in one run: the TRL peer baseline's artifacts (tokenizer, Llama 4L/128h/4 heads/
ffn 512/vocab 512 policy and reward model, prefs.jsonl), 16 pairs per optimizer step, max_length 256,
AdamW lr 1e-5 constant, no weight decay, grad-clip 1.0, beta 0.1, seed 1234, fp32, 30 steps of which
the first 5 are not timed. Prints median seconds per step and tokens/s, and TRL's s/step over ours.

    python bench/preference_vs_trl.py [--steps 30] [--threads 2] [--repeats 1] [--out runs/bench-preference]

The TRL side runs in its own virtual environment, never in aligner's: ALIGNER_TRL_PYTHON (default
/tmp/trl-venv/bin/python; `python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0
trl transformers datasets accelerate psutil`), driving the peer baseline's own scripts
(ALIGNER_TRL_BENCH_DIR, default ../shared/reference/bench-trl beside the repository: bench_dpo.py,
bench_reward.py, setup_artifacts.py, with their exact TRL configuration). aligner loads the same HF
weights through `aligner convert hf-to-mcore`.

The like-for-like rows run TRL's configuration: DPO with the reference's log-probs computed every
step by a second model (`reference.mode=model`), and both with packed batches (`data.packing=true`:
several pairs per row, a pair's prompt computed once, the padded results). The padded rows and the
precomputed-reference row are extra, labelled as such.

Tokens are the non-padding tokens of the sequences the trained model reads in a step (chosen and
rejected, prompt included), the same count for both stacks. Step time is wall time per optimizer
step (median); CPU s/step is the process's CPU time per step (mean over the timed steps: TRL's harness
records it at each step end, and for aligner this script reads the process's CPU time whenever a step
is appended to metrics.jsonl). With 1 thread (the default, as in the peer baseline's robust
configuration) CPU s/step equals the wall time of a quiet machine and hardly moves under other load,
so the ratio is taken on it. "other cores" is the average CPU use of other processes during a run
(/proc/stat busy time minus the run's own, over its wall time): wall times with more than ~0.3 are
contaminated. `--repeats N` runs every case N times in interleaved rounds. Since this shared VM's speed
drifts within minutes, a ratio pairs each attempt with the peer's attempt of the same round (run minutes
apart at most). The table gives the median of those paired ratios and each of them.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRL_PYTHON = os.environ.get("ALIGNER_TRL_PYTHON", "/tmp/trl-venv/bin/python")
TRL_BENCH_DIR = Path(os.environ.get("ALIGNER_TRL_BENCH_DIR", REPO.parent / "shared" / "reference" / "bench-trl"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


def timed(cmd: list[str], env: dict, cwd: Path, log: Path, metrics: Path | None = None) -> dict:
    """Run `cmd`, returning its wall time, the other processes' average core use meanwhile and, with
    `metrics`, the process's CPU seconds at the moment each line was appended to that file."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, start = _busy_seconds(), time.perf_counter()
    step_cpu = []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if metrics is not None and metrics.exists():
                with open(metrics, "rb") as f:
                    lines = f.read().count(b"\n")
                cpu = _cpu_seconds(proc.pid)
                if cpu is not None:
                    step_cpu += [cpu] * (lines - len(step_cpu))
            time.sleep(0.002)
        result = proc
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    if result.returncode:
        sys.exit(f"{' '.join(cmd[:4])} ... failed with exit code {result.returncode}; see {log}")
    return {"wall_s": wall, "other_cores": max(0.0, (_busy_seconds() - busy - own) / wall), "step_cpu": step_cpu}


def prepare(out: Path, threads: int) -> dict:
    """The peer baseline's artifacts (built by its own script, in the TRL environment) and their
    aligner checkpoints."""
    trl_home = out / "trl"
    env = {**os.environ, **OFFLINE, "TRL_BENCH_HOME": str(trl_home), "BENCH_THREADS": str(threads)}
    art = trl_home / "artifacts"
    if not (art / "setup_info.json").exists():
        timed([TRL_PYTHON, "setup_artifacts.py"], env, TRL_BENCH_DIR, out / "setup.log")
    for name in ("policy", "reward"):
        if not (out / f"{name}_mcore" / "COMPLETE").exists():
            timed([sys.executable, "-m", "aligner.cli", "convert", "hf-to-mcore", "--hf", str(art / name), "--out",
                   str(out / f"{name}_mcore")], os.environ.copy(), REPO, out / f"convert_{name}.log")
    return {"art": art, "trl_home": trl_home}


def run_trl(name: str, script: str, paths: dict, out: Path, steps: int, warmup: int, threads: int,
            attempt: int) -> dict:
    results = out / "trl_results" / str(attempt)
    env = {**os.environ, **OFFLINE, "TRL_BENCH_HOME": str(paths["trl_home"]), "TRL_BENCH_RESULTS": str(results),
           "BENCH_STEPS": str(steps), "BENCH_WARMUP": str(warmup), "BENCH_THREADS": str(threads),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    load = timed([TRL_PYTHON, script], env, TRL_BENCH_DIR, out / f"{name}.{attempt}.log")
    del load["step_cpu"]
    r = json.loads((results / f"{name.removeprefix('trl_')}.json").read_text())
    timed_steps = r["per_step"][warmup:]
    return {"step_s": r["median_step_s"], "min_step_s": r["min_step_s"],
            "cpu_step_s": statistics.fmean(s["cpu_s"] for s in timed_steps),
            "tokens_per_step": r["train_tokens_per_step"], "tokens_per_s": r["e2e_tok_s"], **load}


def run_aligner(name: str, command: str, extra: list[str], paths: dict, out: Path, steps: int, warmup: int,
                threads: int, attempt: int) -> dict:
    run_dir = out / f"{name}.{attempt}"
    overrides = [f"run_dir={run_dir}", f"data.train_path={paths['art'] / 'data' / 'prefs.jsonl'}",
                 f"tokenizer.path={paths['art'] / 'tokenizer'}", f"trainer.max_steps={steps}",
                 "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "trainer.seed=1234",
                 "trainer.save_last=false", "data.max_length=256", "logging.progress=false",
                 "logging.tensorboard=false", f"launcher.threads_per_rank={threads}", "optim.lr=1e-5",
                 "optim.min_lr=1e-6", "optim.scheduler=constant", "optim.warmup_steps=0", "optim.weight_decay=0.0",
                 "optim.adam_beta1=0.9", "optim.adam_beta2=0.999", "optim.adam_eps=1e-8", "optim.clip_grad=1.0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    load = timed([sys.executable, "-m", "aligner.cli", "train", command, *overrides], env, REPO,
                 out / f"{name}.{attempt}.log", metrics=run_dir / "metrics.jsonl")
    cpu = load.pop("step_cpu")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    step = [m["timing/step_s"] for m in metrics]
    tokens = [m["throughput/tokens_per_s"] * m["timing/step_s"] for m in metrics]
    return {"step_s": statistics.median(step), "min_step_s": min(step),
            "cpu_step_s": (cpu[steps - 1] - cpu[warmup - 1]) / (steps - warmup),
            "tokens_per_step": statistics.mean(tokens),
            "tokens_per_s": statistics.median(m["throughput/tokens_per_s"] for m in metrics), **load}


def cases(paths: dict, out: Path) -> dict:
    dpo = ["dpo.beta=0.1", "dpo.loss_type=sigmoid", f"model.pretrained={out / 'policy_mcore'}"]
    rm = ["rm.loss=bt", f"model.pretrained={out / 'reward_mcore'}"]
    return {  # name -> (task, what it is, runner args)
        "trl_dpo": ("dpo", "peer", ("trl", "bench_dpo.py")),
        # TRL's configuration: the reference's log-probs computed every step by a second model
        "aligner_dpo_packed": ("dpo", "like-for-like", ("aligner", "dpo", dpo + ["reference.mode=model",
                                                                                 "data.packing=true"])),
        "aligner_dpo_padded": ("dpo", "extra: padded", ("aligner", "dpo", dpo + ["reference.mode=model",
                                                                                 "data.packing=false"])),
        # not the peer's configuration: reference log-probs computed once before training, as TRL's
        # precompute_ref_log_probs=True would; that pass is not timed
        "aligner_dpo_packed_precomputed_ref": ("dpo", "extra: reference precomputed",
                                               ("aligner", "dpo", dpo + ["data.packing=true",
                                                                         "reference.mode=precompute"])),
        "trl_reward": ("rm", "peer", ("trl", "bench_reward.py")),
        "aligner_rm_packed": ("rm", "like-for-like", ("aligner", "rm", rm + ["data.packing=true"])),
        "aligner_rm_padded": ("rm", "extra: padded", ("aligner", "rm", rm + ["data.packing=false"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each (single-process) run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per case, interleaved in rounds")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--out", default="runs/bench-preference")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not Path(TRL_PYTHON).exists():
        sys.exit(f"no TRL interpreter at {TRL_PYTHON}; create the venv (see this file's doc) or set ALIGNER_TRL_PYTHON")
    paths = prepare(out, args.threads)
    todo = {k: v for k, v in cases(paths, out).items() if not args.only or k in args.only}
    runs: dict[str, list[dict]] = {name: [] for name in todo}
    for attempt in range(args.repeats):
        for name, (_, _, runner) in todo.items():
            if runner[0] == "trl":
                r = run_trl(name, runner[1], paths, out, args.steps, args.warmup, args.threads, attempt)
            else:
                r = run_aligner(name, runner[1], runner[2], paths, out, args.steps, args.warmup, args.threads, attempt)
            print(f"[bench] {name} attempt {attempt}: {r['step_s']:.4f} s/step, {r['cpu_step_s']:.4f} CPU s/step, "
                  f"{r['tokens_per_s']:.0f} tok/s, other cores {r['other_cores']:.2f}", file=sys.stderr, flush=True)
            runs[name].append(r)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": runs}, indent=1))
    print(f"\nCPU, fp32, {args.threads} torch thread(s) per run, 16 pairs (32 sequences) per step, steps "
          f"{args.warmup + 1}..{args.steps}, {args.repeats} attempt(s) per run: medians over attempts; a ratio "
          "pairs each attempt with the peer's attempt of the same round\n")
    print("| task | run | configuration | s/step | CPU s/step | tokens/step | tokens/s (CPU) | "
          "TRL / this (CPU s/step) | per attempt | TRL / this (wall) | other cores (max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(xs):
        return f"{statistics.median(xs):.2f}x" if xs else "n/a"

    for name, (task, what, _) in todo.items():
        mine, peer = runs[name], runs.get("trl_dpo" if task == "dpo" else "trl_reward")
        cpu = [p["cpu_step_s"] / r["cpu_step_s"] for p, r in zip(peer, mine)] if peer else []
        wall = [p["step_s"] / r["step_s"] for p, r in zip(peer, mine)] if peer else []
        per_attempt = " / ".join(f"{x:.2f}" for x in cpu) if cpu else "n/a"

        def median(key):
            return statistics.median(r[key] for r in mine)

        print(f"| {task} | {name} | {what} | {median('step_s'):.4f} | {median('cpu_step_s'):.4f} | "
              f"{median('tokens_per_step'):.0f} | {median('tokens_per_step') / median('cpu_step_s'):.0f} | "
              f"{ratio(cpu)} | {per_attempt} | {ratio(wall)} | {max(r['other_cores'] for r in mine):.2f} |")

if __name__ == "__main__":
    main()
