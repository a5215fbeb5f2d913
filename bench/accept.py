"""The device acceptance kit: the checks a lent GPU runs in one call, each recorded as soon as it ends.

    python bench/accept.py --out DIR [--only NAME ...] [--dry-run] [--budget SECONDS] [--work DIR] [--commit SHA]

On the GPU machine, scripts/device/accept.sh installs the carried wheels and runs this within 9 minutes.
`--dry-run` runs every check on CPU at tiny sizes (fp32 runs stay fp32, bf16 runs are CPU bf16, the ~1B model
becomes a 4-layer one, a few steps); tests/e2e/test_device_kit.py runs it in CI, so the kit cannot rot between loans.
The checks, in order (bench/accept_checks.py holds each, its sizes and its gates, and why this order):
  env         GPU, driver, torch, CUDA, NCCL, megatron-core, TE / TensorRT-LLM present or absent, `aligner doctor`
  sft         20 steps from the same converted weights: CPU fp32 vs CUDA fp32 (relative loss difference <= 1e-3 at
              every step), CUDA bf16 (finite, within 3e-2), packed vs padded
  checkpoint  a step-10 checkpoint resumed CPU -> CUDA, CUDA -> CPU and CUDA -> CUDA, against the uninterrupted runs
  grpo        10 steps, bf16: finite metrics, mismatch/token_prob_error <= 1.1, `aligner doctor` exits 0
  reinforce   the same with algorithm.kl.mode=reward
  generate    a ~1B Llama (random weights, bf16): aligner's engine vs transformers' generate, tokens/s at
              batch 1/32/128, prompt 128, 128 new tokens; batch 1 against the HBM bandwidth bound
  mfu         packed SFT of the same model, bf16, sequence 2048: MFU, and the peak memory against `aligner plan`
  rl_async    GRPO with a separate rollout worker at lag 1
  te          Transformer Engine: the spec transformer_impl=auto builds and why, each spec's checkpoint keys, and
              checkpoints across specs (converted and local into TE, TE into local, TE resumed); without TE
              on a CUDA host, skipped after the same loads with the local spec standing in
  pytest_gpu  `pytest -m gpu`
  trl         GRPO's step against TRL's GRPOTrainer on the same GPU and configuration (bench/rl_vs_trl.py's case)
  ppo         5 steps with the critic service, when PyTriton is installed (a second call carries it)
On the device, where no zygote was handed to it, the kit starts its own and forks its processes from it once a
forked probe has used the GPU (bench/accept_zygote.py).
Each check runs in a process of its own under its own time limit (and the run's --budget), so a hang costs one
check. DIR/accept.json holds the commit, the device and one record per check: status (pass, fail, known_fail,
timeout, skipped, budget: ended when the budget ran out), seconds, expected and measured figures, a reason, and
the tail of its log when it did not pass. `--only` reruns the named checks into an existing accept.json.
DIR/accept.log gets each check's log tail; the runs themselves stay under --work.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from aligner.launch import zygote  # noqa: E402  (stdlib only)
from bench.accept_checks import CHECKS, Context  # noqa: E402
from bench.accept_zygote import KitZygote, probe  # noqa: E402

MIN_CHECK_S = 20  # a check is not started with less of the budget left
LOG_TAIL = 3000  # characters of a check's log kept in its record when it did not pass
# Checks failing for a reason already filed: name -> where it is filed. Their failure is recorded as known_fail.
KNOWN_FAILURES: dict[str, str] = {}


class Stopped(Exception):
    """SIGTERM (accept.sh's timeout): the running check is ended and recorded, then the kit stops."""


def commit_of(given: str | None) -> str:
    """--commit, else ALIGNER_COMMIT, else git's HEAD (+ "-dirty" with uncommitted changes), else "unknown"
    (the device gets a copy of the working tree without .git: pass the commit there)."""
    if given or os.environ.get("ALIGNER_COMMIT"):
        return given or os.environ["ALIGNER_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def device_name(dry: bool) -> str:
    """The card, from nvidia-smi: torch would create a CUDA context in this process, held through every check."""
    if dry:
        return "cpu (dry run)"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True)
        if smi.returncode == 0 and smi.stdout.strip():
            return smi.stdout.strip().splitlines()[0]
    return "cuda"


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def tail(path: Path, chars: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - chars))
        return f.read().decode(errors="replace")


def end_tree(proc: subprocess.Popen, work: Path) -> None:
    """Kill a check's process and every process it started: its session, its descendants that started sessions
    of their own (each run does, and PPO's critic service), and the processes that a zygote forked for it, which
    are not its descendants, with their own: those whose command line names a path under the kit's work directory
    (each run's paths are), this process, its parents and the zygotes aside (the kit's own zygote, whose socket's
    folder may share the work directory's prefix, serves the next checks)."""
    import psutil

    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    under_work = os.path.join(str(work), "")
    victims = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = p.info["cmdline"] or []
            zygote = cmdline[1:3] == ["-m", "aligner.launch.zygote"]
            if p.pid == proc.pid or (p.pid not in spared and not zygote and under_work in " ".join(cmdline)):
                victims += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()


def run_check(name: str, limit: float, args, log: Path, cut: bool = False) -> tuple[dict, bool]:
    """CHECKS[name] in a child process, in a session of its own (so that a timeout ends everything it started),
    forked from a live zygote when ALIGNER_ZYGOTE names one (the test suite's: seconds of imports saved per
    check and per run): (its record, whether the kit was stopped meanwhile). `cut`: `limit` is what was left of
    the run's budget, under the check's own: a check still running then is recorded as "budget", not a timeout."""
    record_path = args.work / "records" / f"{name}.json"
    record_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # every run of the dry run is on the CPU, on any host
    cmd = [sys.executable, "-m", "bench.accept", "--check", name, "--work", str(args.work),
           *(["--dry-run"] if args.dry_run else [])]
    start, wall_start = time.perf_counter(), time.time()
    with open(log, "w") as out:
        proc = zygote.popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        status, stopped = None, False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            status = ({"status": "budget", "reason": f"ended after {limit:.0f} s, when the run's budget ran out"}
                      if cut else {"status": "timeout", "reason": f"still running after its limit of {limit:.0f} s"})
        except Stopped:
            status = {"status": "timeout", "reason": "the kit was stopped (SIGTERM) while this check ran"}
            stopped = True
        finally:
            if proc.poll() is None:
                end_tree(proc, args.work)
    seconds = time.perf_counter() - start
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    if status is not None:
        record.update(status)
        append_command_tails(args.work / "checks" / name, log, since=wall_start)
    elif not record:
        record = {"status": "fail", "reason": f"the check's process exited {proc.returncode} without a record"}
    record["seconds"] = round(seconds, 1)
    if record["status"] == "fail" and name in KNOWN_FAILURES:
        record.update(status="known_fail", known=KNOWN_FAILURES[name])
    if record["status"] not in ("pass", "skipped"):
        record["error"] = tail(log, LOG_TAIL)
    return record, stopped


def append_command_tails(folder: Path, log: Path, since: float) -> None:
    """The tails of the command logs (Context.logged) that a check wrote since `since`, added to its log: a check
    ended at its limit never printed the output of the command it was waiting for."""
    runs = sorted((p for p in folder.glob("run*_*.*") if p.stat().st_mtime >= since), key=lambda p: p.name)
    with open(log, "a") as out:
        for path in runs:
            out.write(f"\n--- {path.name} (its last {LOG_TAIL} characters) ---\n{tail(path, LOG_TAIL)}\n")


def child(name: str, work: Path, dry: bool) -> None:
    """Run one check in this process and write its record (the parent adds the time and the log tail)."""
    ctx = Context(work, name, dry)
    try:
        verdict = CHECKS[name][0](ctx)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the bench helpers end a failed command with sys.exit
        traceback.print_exc()
        verdict = {"status": "fail", "reason": f"{type(e).__name__}: {str(e)[-500:]}"}
    record = {"status": verdict["status"], "reason": verdict.get("reason"), "expected": ctx.expected,
              "measured": ctx.measured}
    (work / "records").mkdir(parents=True, exist_ok=True)
    write_json(work / "records" / f"{name}.json", record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/accept")),
                        help="where accept.json and accept.log go (default: $OUT, else runs/accept)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"rerun these checks: {', '.join(CHECKS)}")
    parser.add_argument("--dry-run", action="store_true", help="every check on CPU at tiny sizes")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all checks together")
    parser.add_argument("--work", type=Path, default=Path("/tmp/aligner-accept"), help="runs and assets")
    parser.add_argument("--commit", help="the commit this tree is (default: git's HEAD, else $ALIGNER_COMMIT)")
    parser.add_argument("--check", help=argparse.SUPPRESS)  # internal: run one check in this process
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # internal: bench/accept_zygote.py
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    if args.check:
        child(args.check, args.work, args.dry_run)
        return 0
    if args.probe:
        return probe()
    unknown = [n for n in args.only or [] if n not in CHECKS]
    if unknown:
        parser.error(f"unknown check {', '.join(unknown)}; the checks are {', '.join(CHECKS)}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device here; `--dry-run` runs the kit on CPU at tiny sizes", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only:  # a full run starts clean; --only reuses the assets and runs and adds to the report
        shutil.rmtree(args.work, ignore_errors=True)
        (args.out / "accept.log").unlink(missing_ok=True)
    (args.work / "logs").mkdir(parents=True, exist_ok=True)
    result_path = args.out / "accept.json"
    previous = json.loads(result_path.read_text()) if args.only and result_path.exists() else {}
    commit = commit_of(args.commit)
    result = {"kit": "bench/accept.py", "commit": commit, "device": device_name(args.dry_run),
              "dry_run": args.dry_run, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "budget_s": args.budget, "checks": previous.get("checks", {})}
    if previous and previous.get("commit") != commit:
        result["previous_commit"] = previous.get("commit")

    def stop(signum, frame):
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + args.budget  # the zygote's start and probe count: accept.sh's margin is for the rest
    kit_zygote = None if args.dry_run else KitZygote()
    if kit_zygote is not None:
        result["zygote"] = kit_zygote.state
        print(f"accept: zygote {kit_zygote.state}", flush=True)
    todo = [n for n in CHECKS if not args.only or n in args.only]
    print(f"accept: {len(todo)} check(s) on {result['device']}, commit {commit}, budget {args.budget:.0f} s",
          flush=True)
    try:
        for name in todo:
            left = deadline - time.monotonic()
            own = CHECKS[name][2 if args.dry_run else 1]
            limit = min(own, left)
            log = args.work / "logs" / f"{name}.log"
            stopped = False
            if limit < MIN_CHECK_S:
                record = {"status": "skipped", "reason": f"the run's budget was spent ({left:.0f} s left)",
                          "seconds": 0.0}
            else:
                record, stopped = run_check(name, limit, args, log, cut=limit < own)
            record["commit"] = commit
            result["checks"][name] = record
            write_json(result_path, result)
            with open(args.out / "accept.log", "a") as f:
                f.write(f"\n===== {name}: {record['status']} in {record['seconds']} s =====\n{tail(log, 20000)}")
            print(f"accept: {name:11s} {record['status']:10s} {record['seconds']:6.1f} s"
                  + (f"  {record['reason']}" if record.get("reason") else ""), flush=True)
            if stopped:
                raise Stopped()
    except Stopped:
        print("accept: stopped (SIGTERM)", file=sys.stderr)
        return 124
    finally:
        if kit_zygote is not None:
            kit_zygote.stop()
    bad = [n for n in todo if result["checks"][n]["status"] in ("fail", "timeout")]
    print(f"accept: {result_path}" + (f"; not passed: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
