"""Asynchronous RL's speed (issue 35, item 6): aligner's GRPO colocated and synchronous, with one separate
rollout worker at lag 0 and at lag 1, and TRL's GRPOTrainer, in one run on this 2-core CPU.

    python bench/rl_async.py [--tokens 16 64] [--prompts 8] [--steps 30] [--warmup 5] [--repeats 3]
        [--only CASE ...] [--out runs/bench-rl-async] [--json FILE] [--from-json FILE]

The configuration is bench/rl_vs_trl.py's (its helpers run every case here): the TRL peer baseline's tiny
Llama (4 layers, hidden 128, 4 heads, ffn 512, vocab 512), 8 prompts x 4 samples = 32 per step, KL 0.04 (k3,
in the loss), token-mean loss, one optimizer step per batch, AdamW lr 1e-5, fp32, the exact-answer reward
in one reward worker, steps `--warmup`+1.. timed. Two shapes: the baseline's 16 new tokens, and 64 (`--tokens`),
where generation is a third of the synchronous step, against a quarter at 16 (the random-init policy almost
never samples eos, so responses run to the limit on both sides). `--prompts 2` (8 samples a step, aligner's cases
only: the baseline's TRL script has 8 prompts) is a shape where generation takes as long as the rest of the step.
`--from-json` reports a results file again (results are written after every round).

Cases, run in interleaved rounds (`--repeats`), each shape's cases one after another within a round:
  * colocated: `aligner train grpo`, 1 torch thread, pinned to core 0 (the synchronous loop);
  * separate_k0 / separate_k1: `generation.placement=separate generation.workers=1 algorithm.async.max_lag=K`,
    1 torch thread in each process (launcher.threads_per_rank=1: the trainer and, through OMP_NUM_THREADS,
    the worker); the trainer pinned to core 0 and the rollout worker to core 1;
  * colocated_2t: the colocated run with 2 torch threads and no pinning (both cores, as k=1 uses);
  * trl_grpo: TRL's GRPOTrainer through the baseline's bench_grpo.py (bench/trl_device.py for 64 tokens),
    2 torch threads, no pinning: both cores.
Pinning: a thread of this script walks the run's process tree (its child, the CLI, and every descendant)
every 50 ms and sets every thread of each with sched_setaffinity: the rollout worker's (found by its command
line) to {1}, the rest (the trainer, its reward worker) to {0}; a worker starts on core 0 (it inherits its
parent's) and moves at the next scan, long before its imports end.

Per step (median over the timed steps, then over rounds): wall s/step (metrics.jsonl `timing/step_s`; TRL's
harness: between step ends) and where it goes: aligner's generate (colocated), generation_wait (the trainer
idle for the worker), broadcast, logprobs, reference, train, score_wait, the rest; the worker's generation
(its busy fraction x the step); TRL's generate and the rest. Ratios pair attempts of the same round. The
targets (64 tokens): k=1 <= 0.65x colocated, and TRL / k=1 >= 2x. The overlap bound says what a perfect
pipeline reaches from the colocated step's own parts: max(generation, the rest of the step) + k=1's
broadcast, over the colocated step; `uptime`'s load before and after each round is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import rl_vs_trl  # noqa: E402
from bench.preference_vs_trl import prepare  # noqa: E402

TARGET_K1_OVER_COLOCATED = 0.65
TARGET_TRL_OVER_K1 = 2.0
GRPO = rl_vs_trl.cases()["aligner_grpo"][2]  # the like-for-like GRPO overrides
SEPARATE = ["generation.placement=separate", "generation.workers=1"]
CASES = {  # name -> (extra overrides or None for TRL, torch threads, pinned)
    "colocated": (GRPO, 1, True),
    "separate_k0": ([*GRPO, *SEPARATE, "algorithm.async.max_lag=0"], 1, True),
    "separate_k1": ([*GRPO, *SEPARATE, "algorithm.async.max_lag=1"], 1, True),
    "colocated_2t": (GRPO, 2, False),
    "trl_grpo": (None, 2, False),
}
WORKER = "rollout_worker"  # in a rollout worker's command line (aligner.generation.rollout_worker:main)
ASYNC_PHASES = ("generation_wait", "broadcast")


class Pinner(threading.Thread):
    """Pins this script's child processes and all their descendants (the run's), every thread of each, at
    every scan until `stop`: rollout workers (by command line) to core 1, the rest to core 0."""

    def __init__(self):
        super().__init__(daemon=True)
        self.done, self.pinned, self.workers = threading.Event(), {}, set()  # pid -> cores; rollout workers

    def run(self) -> None:
        while not self.done.is_set():
            todo = children(os.getpid())
            while todo:
                pid = todo.pop()
                cores = {1} if WORKER in " ".join(rl_vs_trl._cmdline(pid)) else {0}
                try:
                    tasks = os.listdir(f"/proc/{pid}/task")
                except OSError:  # ended
                    continue
                for task in tasks:
                    try:
                        os.sched_setaffinity(int(task), cores)
                    except OSError:  # a thread that ended
                        pass
                self.pinned[pid] = cores
                if cores == {1}:
                    self.workers.add(pid)
                todo += children(pid)
            self.done.wait(0.05)

    def stop(self) -> dict:
        self.done.set()
        self.join()
        return {"worker_pids": sorted(self.workers), "core0_pids": sorted(set(self.pinned) - self.workers)}


def children(pid: int) -> list[int]:
    try:
        out = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        return out
    except OSError:
        return []


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def async_parts(run_dir: Path, warmup: int) -> dict:
    """The phases rl_vs_trl.run_aligner leaves out, from the run's timed steps (medians): generation wait,
    broadcast, the worker's busy fraction and its generation seconds (busy fraction x the step)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "timing/step_s" in m][warmup:]
    out = {p: statistics.median(m.get(f"timing/{p}_s", 0.0) for m in steps)  # none in a step that sends nothing
           for p in ASYNC_PHASES if any(f"timing/{p}_s" in m for m in steps)}
    if "async/worker_0_busy_fraction" in steps[0]:
        out["worker_busy_fraction"] = statistics.median(m["async/worker_0_busy_fraction"] for m in steps)
        out["worker_generate"] = statistics.median(m["async/worker_0_busy_fraction"] * m["timing/step_s"]
                                                   for m in steps)
        out["lag"] = statistics.median(m["async/lag"] for m in steps)
    return out


def run_case(name: str, tokens: int, paths: dict, out: Path, args, attempt: int) -> dict:
    extra, threads, pinned = CASES[name]
    prompts = getattr(args, "prompts", rl_vs_trl.RUN["prompts_per_step"])
    if extra is None:
        if prompts != rl_vs_trl.RUN["prompts_per_step"]:
            sys.exit("--prompts other than the baseline's 8 runs aligner's cases only (--only colocated ...)")
        return rl_vs_trl.run_trl(name, paths, out, args.steps, args.warmup, threads, attempt,
                                 max_new_tokens=None if tokens == rl_vs_trl.RUN["max_new_tokens"] else tokens)
    pinner = Pinner() if pinned else None
    if pinner:
        pinner.start()
    try:
        n = prompts * rl_vs_trl.RUN["num_generations"]
        batch = [f"algorithm.prompts_per_step={prompts}", f"trainer.global_batch_size={n}",
                 f"trainer.micro_batch_size={n}"]
        r = rl_vs_trl.run_aligner(name, "grpo", [*extra, f"sampling.max_new_tokens={tokens}", *batch], paths, out,
                                  args.steps, args.warmup, threads, attempt)
        r["generated_tokens_per_step"] *= prompts / rl_vs_trl.RUN["prompts_per_step"]  # run_aligner counts 8 prompts
    finally:
        pins = pinner.stop() if pinner else None
    if pinner and (not pins["worker_pids"]) != (name.startswith("colocated")):
        sys.exit(f"{name}: pinning found worker processes {pins['worker_pids']}: expected "
                 f"{'none' if name.startswith('colocated') else 'one'}")
    r["phases"].update(async_parts(out / f"{name}.{attempt}", args.warmup))
    # rl_vs_trl's `other` counts the generation wait and the broadcast in: take them out
    r["phases"]["other"] -= sum(r["phases"].get(p, 0.0) for p in ASYNC_PHASES)
    r["pinned"] = pins
    return r


def summarize(runs: dict) -> dict:
    """Per shape: each case's medians over rounds, the paired ratios and the overlap bound."""
    out = {}
    for tokens, by_case in runs.items():
        s = {}
        for name, attempts in by_case.items():
            phases = sorted({p for r in attempts for p in r["phases"]})
            s[name] = {"step_s": statistics.median(r["step_s"] for r in attempts),
                       "steps_s_per_round": [r["step_s"] for r in attempts],
                       "min_step_s": min(r["min_step_s"] for r in attempts),
                       "phases": {p: statistics.median(r["phases"][p] for r in attempts if p in r["phases"])
                                  for p in phases},
                       "generated_tokens_per_step": statistics.median(r["generated_tokens_per_step"] for r in attempts),
                       "other_cores_max": max(r["other_cores"] for r in attempts)}

        def paired(a: str, b: str) -> list[float]:
            return [x["step_s"] / y["step_s"] for x, y in zip(by_case[a], by_case[b])]

        ratios = {}
        for name in by_case:
            if name != "colocated" and "colocated" in by_case:
                ratios[f"{name}/colocated"] = paired(name, "colocated")
            if name != "trl_grpo" and "trl_grpo" in by_case:
                ratios[f"trl_grpo/{name}"] = paired("trl_grpo", name)
        fastest = {}  # the same ratios of each case's fastest step over all rounds: the least loaded moments
        for key in ratios:
            a, b = key.split("/")
            fastest[key] = s[a]["min_step_s"] / s[b]["min_step_s"]
        bound = []  # a perfect pipeline from the colocated step's parts, with k=1's own broadcast
        if "colocated" in by_case and "separate_k1" in by_case:
            for c, k1 in zip(by_case["colocated"], by_case["separate_k1"]):
                generate = c["phases"]["generate"]
                step = max(generate, c["step_s"] - generate) + k1["phases"].get("broadcast", 0.0)
                bound.append({"step_s": step, "over_colocated": step / c["step_s"],
                              "trl_over": (by_case["trl_grpo"][len(bound)]["step_s"] / step
                                           if "trl_grpo" in by_case else None)})
        out[tokens] = {"cases": s, "ratios": {k: {"median": statistics.median(v), "per_round": v,
                                                  "fastest_steps": fastest[k]} for k, v in ratios.items()},
                       "overlap_bound": {"per_round": bound,
                                         "over_colocated": statistics.median(b["over_colocated"] for b in bound)
                                         if bound else None}}
    return out


def report(summary: dict, args) -> None:
    print(f"\nCPU (2 cores), fp32, {getattr(args, 'prompts', 8)} prompts x 4 samples, steps {args.warmup + 1}.."
          f"{args.steps}, {args.repeats} round(s): wall s/step, medians over rounds; ratios pair the runs of a round: "
          "median (each round)")
    parts = ("generate", "worker_generate", "generation_wait", "broadcast", "logprobs", "reference", "train",
             "score_wait", "other")
    for tokens, s in summary.items():
        print(f"\n{tokens} new tokens\n")
        print(f"| case | s/step | fastest step | {' | '.join(parts)} | worker busy | other cores (max) |")
        print("|---|---|---|" + "---|" * (len(parts) + 2))
        for name, c in s["cases"].items():
            cells = [f"{c['phases'][p]:.4f}" if p in c["phases"] else "" for p in parts]
            busy = c["phases"].get("worker_busy_fraction")
            busy = "" if busy is None else f"{busy:.2f}"
            print(f"| {name} | {c['step_s']:.4f} | {c['min_step_s']:.4f} | {' | '.join(cells)} | {busy} | "
                  f"{c['other_cores_max']:.2f} |")
        print()
        for key, r in s["ratios"].items():
            print(f"  {key}: {r['median']:.2f}x ({' / '.join(f'{x:.2f}' for x in r['per_round'])}); "
                  f"fastest steps: {r['fastest_steps']:.2f}x")
        b = s["overlap_bound"]
        if b["per_round"]:
            steps = " / ".join(f"{x['step_s']:.4f}" for x in b["per_round"])
            trl = " / ".join(f"{x['trl_over']:.2f}" for x in b["per_round"] if x["trl_over"])
            print(f"  overlap bound max(generate, rest) + broadcast: {steps} s = {b['over_colocated']:.2f}x "
                  f"colocated; TRL over it: {trl}")
        k1, trl = s["ratios"].get("separate_k1/colocated"), s["ratios"].get("trl_grpo/separate_k1")
        if k1:
            print(f"  target k=1 <= {TARGET_K1_OVER_COLOCATED}x colocated: "
                  f"{'met' if k1['median'] <= TARGET_K1_OVER_COLOCATED else 'not met'} ({k1['median']:.2f}x)")
        if trl:
            print(f"  target TRL / k=1 >= {TARGET_TRL_OVER_K1}x: "
                  f"{'met' if trl['median'] >= TARGET_TRL_OVER_K1 else 'not met'} ({trl['median']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64], help="new tokens per response")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (x 4 samples); TRL runs only at 8")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: every case of every shape once each")
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="case names (default: all)")
    parser.add_argument("--out", default="runs/bench-rl-async")
    parser.add_argument("--json", help="also write the results here (e.g. bench/results/rl-async-cpu.json)")
    parser.add_argument("--from-json", help="summarize and report a results file again; runs nothing")
    args = parser.parse_args()
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        for key in ("steps", "warmup", "repeats"):
            setattr(args, key, result["args"][key])
        result["summary"] = summarize(result["results"])
        report(result["summary"], args)
        Path(args.from_json).write_text(json.dumps(result, indent=1, default=str))
        return
    if args.steps <= args.warmup:
        sys.exit(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("this bench pins the trainer and the worker to cores 0 and 1: it needs both")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    paths = prepare(out, 1)
    names = [n for n in CASES if not args.only or n in args.only]
    runs = {tokens: {name: [] for name in names} for tokens in args.tokens}
    loads = []
    for attempt in range(args.repeats):
        before = load()
        for tokens in args.tokens:
            shape_out = out / f"tokens_{tokens}"
            shape_out.mkdir(exist_ok=True)
            if not (shape_out / "policy_mcore").exists():
                (shape_out / "policy_mcore").symlink_to(out / "policy_mcore")
            for name in names:
                r = run_case(name, tokens, paths, shape_out, args, attempt)
                print(f"[bench] {tokens} tokens, {name}, round {attempt}: {r['step_s']:.4f} s/step, "
                      f"{r['generated_tokens_per_step']:.0f} generated tokens/step, other cores "
                      f"{r['other_cores']:.2f}", file=sys.stderr, flush=True)
                runs[tokens][name].append(r)
        loads.append({"round": attempt, "before": before, "after": load()})
        print(f"[bench] round {attempt}: load before: {before}; after: {loads[-1]['after']}", file=sys.stderr,
              flush=True)
        result = {"args": {**vars(args), "rounds_done": attempt + 1}, "run": rl_vs_trl.RUN,
                  "cases": {k: [v[0], v[1], v[2]] for k, v in CASES.items()},
                  "host": {"cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                           "commit": subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                                                    capture_output=True, text=True).stdout.strip()},
                  "load": loads, "summary": summarize(runs), "results": runs}
        for path in filter(None, [out / "results.json", args.json and Path(args.json)]):  # after every round
            path.write_text(json.dumps(result, indent=1, default=str))
    report(result["summary"], args)
    print(f"\nall numbers: {out / 'results.json'}")


if __name__ == "__main__":
    main()
