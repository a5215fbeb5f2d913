"""`aligner doctor RUN_DIR`: name the known failure symptoms of a run from its files.

Reads `<run_dir>/metrics.jsonl` (the names algorithms/online/rl.py, ppo_trainer.py, samples.py and shared/trainer.py
write), `config.yaml`, `checkpoints/` and the text logs under the run directory (run_files.py reads them).
Each rule is a small pure function of a `Run` returning at most one `Finding`: the step where the symptom
started, what was seen (numbers), what to try. No torch here: this runs on a laptop beside the run's files.

Exit code: 0 healthy; 1 when a symptom was found (a `step N: ...` line for each on stdout) or a run
directory could not be read (`RunDirError`, a `UserError`: aligner.cli prints its one `error:` line).
Log findings carry the step the logs name (a lost service's), else `step ?`: the quoted line has its time.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable

from aligner.observe.run_files import (RunDirError, checked_run_dir, read_checkpoints, read_config, read_logs,
                                       read_rows)

# ---- thresholds ------------------------------------------------------------------------------------
BASELINE_STEPS = 3  # a run's first logged steps are its own baseline: levels differ by model and task
PERSIST_STEPS = 5  # a trend must hold this many consecutive logged steps: real runs show lone 5x dips
GRAD_SPIKE_FACTOR = 10.0  # x the median of recent nonzero norms (sparse-reward RL swings ~3x step to step)
GRAD_SPIKE_WINDOW = 10  # recent steps that median is taken over
LOSS_SPIKE_FACTOR = 2.0  # x the recent median of a positive loss (SFT/RM/DPO)...
LOSS_SPIKE_MIN = 0.5  # ...and up by at least this many nats: smaller jumps of a near-0 loss are noise
KL_FLOOR = 0.1  # nats/token: below this the policy is still close to the reference, whatever the trend
KL_GROWTH = 1.5  # the last steps' KL over mid-run's: a KL that settles gives ~1, one still climbing more
LENGTH_BLOWUP, LENGTH_COLLAPSE = 2.0, 0.5  # response length x its baseline: outside, the policy changed style
REWARD_RISE_STD = 0.5  # a reward rise counts past half the baseline's within-step reward std
TOKEN_PROB_ERROR_MAX = 1.1  # NeMo-RL's gate on mean exp|log p_trainer - log p_engine|; 1.0 = exact match
CLIP_FRACTION_HIGH = 0.3  # healthy PPO clips ~0.05-0.2 of tokens; more, for long, is updates too large
ENDED_DROP = 0.25  # a quarter more of the samples now cut at max_new_tokens than at the start
THROUGHPUT_DROP = 0.5  # tokens/s below half the baseline: a slowdown, not noise

THROUGHPUT_KEYS = ("throughput/generated_tokens_per_s", "throughput/tokens_per_s")  # RL, then the shared loop
RETRY = re.compile(r"\(attempt \d+ of \d+\)\s*$|; asking again\s*$")  # servers/client.py, algorithms/online/ppo.py
TIMEOUT = re.compile(r"gave no answer within|timed out|timeout: ", re.IGNORECASE)  # client.py; scoring.py's status
SERVICE_LOST = re.compile(r"stopped during step (\d+): the last checkpoint is consistent")  # ppo_trainer.py
NO_SERVER = re.compile(r"no (?:reward or verifier|\w+) server (?:ready )?at ")  # rewards/scoring.py, client.py
UNSCORED_LINE = re.compile(r"samples unscored|could not score their sample")  # rewards/scoring.py


@dataclass(frozen=True)
class Finding:
    rule: str
    step: int | None  # where the symptom started; None when the logs cannot say
    seen: str  # what was seen, with numbers
    advice: str  # what to try

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "step ?"
        return f"{where}: {SYMPTOMS[self.rule]} — {self.seen}; try: {self.advice}"


@dataclass
class Run:
    rows: list[dict]  # metrics.jsonl, in order
    config: dict = field(default_factory=dict)  # config.yaml ({} when absent)
    logs: dict[str, str] = field(default_factory=dict)  # path relative to run_dir -> text
    checkpoints: list[int] = field(default_factory=list)  # steps of the complete checkpoints
    partial: list[str] = field(default_factory=list)  # names of checkpoints left half-written

    def setting(self, dotted: str, default=None):
        node = self.config
        for key in dotted.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        return default if node is None else node


# ---- series helpers -------------------------------------------------------------------------------
def series(rows: list[dict], key: str, finite: bool = True) -> list[tuple[int, float]]:
    """(step, value) of the training steps that logged `key` (step 0 holds only the first validation)."""
    points = [(r["step"], r[key]) for r in rows if key in r and r["step"] > 0]
    return [(s, v) for s, v in points if math.isfinite(v)] if finite else points


def median(points: list[tuple[int, float]]) -> float:
    return statistics.median(v for _, v in points)


def since(points: list[tuple[int, float]], start: int) -> list[tuple[int, float]]:
    return [p for p in points if p[0] >= start]


def sustained(points: list[tuple[int, float]], test: Callable[[float], bool], span: int = PERSIST_STEPS):
    """The first step of the first `span` consecutive points passing `test`, or None."""
    count = 0
    for i, (_, value) in enumerate(points):
        count = count + 1 if test(value) else 0
        if count == span:
            return points[i - span + 1][0]
    return None


def left_baseline(points: list[tuple[int, float]], test: Callable[[float, float], bool]):
    """(baseline, first step of a sustained departure): `test(value, baseline)` held PERSIST_STEPS steps
    in a row after the BASELINE_STEPS steps that give the baseline; (baseline, None) when it never did."""
    if len(points) < BASELINE_STEPS + PERSIST_STEPS:
        return None, None
    base = median(points[:BASELINE_STEPS])
    return base, sustained(points[BASELINE_STEPS:], lambda v: test(v, base))


# ---- rules ----------------------------------------------------------------------------------------
def nonfinite(run: Run) -> Finding | None:
    # an RL step without any update (every sample unscored or filtered) logs grad_norm NaN on purpose
    updated = [r for r in run.rows if r.get("optimizer_steps", 1) > 0]
    for key in ("loss", "grad_norm"):
        bad = [(s, v) for s, v in series(updated, key, finite=False) if not math.isfinite(v)]
        if bad:
            return Finding("nonfinite", bad[0][0], f"{key} = {bad[0][1]} ({len(bad)} step(s) in all)",
                           f"resume from a checkpoint before step {bad[0][0]} with a lower optim.lr and optim.clip_grad"
                           " on; prefer bf16 to fp16; look for a bad sample in that step's data")
    return None


def grad_norm_spike(run: Run) -> Finding | None:
    points, clip = series(run.rows, "grad_norm"), run.setting("optim.clip_grad", 0.0) or 0.0
    for i, (step, value) in enumerate(points):
        recent = [p for p in points[max(0, i - GRAD_SPIKE_WINDOW):i] if p[1] > 0]  # 0 = no signal that step
        # under optim.clip_grad a jump is one the run was set up to take as it is (sparse rewards do it)
        if len(recent) >= BASELINE_STEPS and value > GRAD_SPIKE_FACTOR * median(recent) and value > clip:
            return Finding("grad_norm_spike", step, f"grad_norm {value:.4g} is {value / median(recent):.0f}x the "
                           f"median {median(recent):.3g} of the {len(recent)} steps before (optim.clip_grad={clip:g})",
                           "lower optim.lr or add optim.warmup_steps; look for outliers in that step's batch "
                           f"(rollouts/step_{step:06d}.jsonl for RL)")
    return None


def loss_spike(run: Run) -> Finding | None:
    if any("reward/mean" in r for r in run.rows):  # RL: a surrogate loss, whose level tracks the advantages
        return None
    points = series(run.rows, "loss")
    for i, (step, value) in enumerate(points):
        recent = points[max(0, i - GRAD_SPIKE_WINDOW):i]
        if len(recent) < BASELINE_STEPS or min(v for _, v in recent) <= 0:
            continue
        base = median(recent)
        if value > LOSS_SPIKE_FACTOR * base and value - base > LOSS_SPIKE_MIN:
            return Finding("loss_spike", step, f"loss {value:.4g} after a median {base:.4g} over the {len(recent)} "
                           "steps before", "lower optim.lr or add optim.warmup_steps; check the data of that step")
    return None


def kl_growth(run: Run) -> Finding | None:
    points = series(run.rows, "kl/mean")
    if len(points) < 2 * PERSIST_STEPS:
        return None
    half = len(points) // 2
    mid, last = median(points[half - PERSIST_STEPS:half]), median(points[-PERSIST_STEPS:])
    if last < KL_FLOOR or last < KL_GROWTH * max(mid, 0.0):
        return None
    start = next(s for s, v in points if v >= KL_FLOOR)
    return Finding("kl_growth", start, f"kl/mean median {last:.3g} over the last {PERSIST_STEPS} steps, {mid:.3g} "
                   f"mid-run (kl/coef {run.rows[-1].get('kl/coef', run.setting('algorithm.kl.coef', '?'))})",
                   "raise algorithm.kl.coef or set algorithm.kl.target (adaptive), lower optim.lr")


def reward_hacking(run: Run) -> Finding | None:
    lengths, rewards = series(run.rows, "response_length/mean"), series(run.rows, "reward/mean")
    base_len, start = left_baseline(lengths, lambda v, base: not LENGTH_COLLAPSE * base < v < LENGTH_BLOWUP * base)
    if start is None or len(rewards) < BASELINE_STEPS:
        return None
    base_reward = median(rewards[:BASELINE_STEPS])
    stds = series(run.rows, "reward/std")[:BASELINE_STEPS]  # the reward's own scale, 0 when not logged
    later = since(rewards, start)
    if not later or median(later) - base_reward <= REWARD_RISE_STD * (median(stds) if stds else 0.0):
        return None
    now = median(since(lengths, start))
    return Finding("reward_hacking", start, f"response_length/mean {base_len:.3g} -> {now:.3g} while reward/mean "
                   f"{base_reward:.3g} -> {median(later):.3g}",
                   "read rollouts/step_*.jsonl from that step: the reward is being gamed by length; add a length "
                   "penalty (algorithm.overlong.buffer), raise algorithm.kl.coef, or fix the reward")


def token_prob_error(run: Run) -> Finding | None:
    # a lagged step's samples come from an older policy on purpose (asynchronous RL): its mismatch measures the
    # policy's drift too, which the importance weights correct; only lag-0 steps show the engine's own error
    lagged = {row["step"] for row in run.rows if row.get("async/lag", 0.0) > 0}
    points = [(s, v) for s, v in series(run.rows, "mismatch/token_prob_error") if s not in lagged]
    bad = [(s, v) for s, v in points if v > TOKEN_PROB_ERROR_MAX]
    if not bad:
        return None
    return Finding("token_prob_error", bad[0][0], f"mismatch/token_prob_error {bad[0][1]:.4g} > {TOKEN_PROB_ERROR_MAX} "
                   f"(max {max(v for _, v in bad):.4g}, {len(bad)} of {len(points)} steps)",
                   "the engine samples from other probabilities than the trainer computes: check precision "
                   "(model.params_dtype), generation.decode and refits (generation.check_refit=true); "
                   "algorithm.importance_sampling.level=token corrects a small mismatch")


def refit_check(run: Run) -> Finding | None:
    bad = [r for r in run.rows if r.get("refit/bitwise", 1.0) < 1.0]
    if not bad:
        return None
    return Finding("refit_check", bad[0]["step"], f"refit/bitwise 0 with refit/max_abs_diff "
                   f"{bad[0].get('refit/max_abs_diff', float('nan')):.3g} ({len(bad)} step(s))",
                   "the engine generates with weights other than the trainer's: check that every refit ran and "
                   "loaded every parameter (an engine kept in another dtype on purpose differs by rounding only)")


def clip_fraction(run: Run) -> Finding | None:
    points = series(run.rows, "policy/clip_fraction")
    start = sustained(points, lambda v: v > CLIP_FRACTION_HIGH)
    if start is None:
        return None
    return Finding("clip_fraction", start, f"policy/clip_fraction above {CLIP_FRACTION_HIGH} for {PERSIST_STEPS}+ "
                   f"steps (median {median(since(points, start)):.3g} from then)",
                   "each update moves the policy too far: lower optim.lr, fewer algorithm.ppo_epochs, or fewer "
                   "minibatches per step (a larger trainer.global_batch_size)")


def ended_falling(run: Run) -> Finding | None:
    points = series(run.rows, "fraction/ended")
    base, start = left_baseline(points, lambda v, base: v < base - ENDED_DROP)
    if start is None:
        return None
    return Finding("ended_falling", start, f"fraction/ended {base:.2f} at the start, "
                   f"{median(since(points, start)):.2f} from then on",
                   f"more responses are cut at sampling.max_new_tokens={run.setting('sampling.max_new_tokens', '?')}: "
                   "raise it, add the over-long penalty (algorithm.overlong.buffer) or mask cut samples "
                   "(algorithm.overlong.mask=true)")


def unscored(run: Run) -> Finding | None:
    points = [p for p in series(run.rows, "fraction/unscored") if p[1] > 0]
    if not points:
        return None
    why = next((ln.strip() for text in run.logs.values() for ln in text.splitlines() if UNSCORED_LINE.search(ln)), "")
    worst = max(v for _, v in points)
    return Finding("unscored", points[0][0], f"fraction/unscored {points[0][1]:.3g} (max {worst:.3g}, {len(points)} "
                   "step(s))" + (f"; the logs say: {why[-200:]}" if why else ""),
                   "unscored samples are masked out of learning: fix the reward function or data that returns None, "
                   "or the reward server (raise reward.timeout_s if it timed out)")


def service_trouble(run: Run) -> Finding | None:
    hits = [(name, line) for name, text in run.logs.items() for line in text.splitlines()
            if RETRY.search(line) or TIMEOUT.search(line) or SERVICE_LOST.search(line) or NO_SERVER.search(line)]
    if not hits:
        return None
    lost = next((int(m[1]) for _, line in hits if (m := SERVICE_LOST.search(line))), None)
    first = hits[0][1]
    retries = sum(bool(RETRY.search(line)) for _, line in hits)
    timeouts = sum(bool(TIMEOUT.search(line)) for _, line in hits)
    return Finding("service_trouble", lost,
                   f"{retries} retried request(s), {timeouts} timeout line(s)"
                   + (f", the run stopped at step {lost} (service lost)" if lost else "")
                   + f"; first in {hits[0][0]}: {first.strip()[-200:]}",
                   "the reward/critic service was slow, restarting or overloaded: read critic/server.log or the "
                   "server's own log; raise critic.timeout_s / reward.timeout_s or send smaller batches")


def throughput_drop(run: Run) -> Finding | None:
    key = next((k for k in THROUGHPUT_KEYS if any(k in r for r in run.rows)), None)
    points = series(run.rows, key) if key else []  # (a slow warm-up first step moves no median of 3)
    base, start = left_baseline(points, lambda v, base: v < THROUGHPUT_DROP * base)
    if start is None:
        return None
    return Finding("throughput_drop", start, f"{key} {base:.4g} at the start, "
                   f"{median(since(points, start)):.4g} from then on{slowest_phase(run, start)}",
                   "compare the timing/*_s columns before and after that step; check host load and memory, a slow "
                   "service (timing/score_wait_s, timing/critic_wait_s) and growing response lengths")


def slowest_phase(run: Run, start: int) -> str:
    """', timing/X_s grew Nx' for the phase that slowed the most after `start` ('' when none is logged)."""
    growth = {}
    for key in {k for r in run.rows for k in r if k.startswith("timing/") and k != "timing/step_s"}:
        points = series(run.rows, key)
        before, after = [p for p in points if p[0] < start], since(points, start)
        if before and after and median(before) > 0:
            growth[key] = median(after) / median(before)
    worst = max(growth, key=growth.get, default=None)
    return f", {worst} grew {growth[worst]:.1f}x" if worst and growth[worst] > 1 else ""


def no_final_checkpoint(run: Run) -> Finding | None:
    steps = [r["step"] for r in run.rows if r["step"] > 0]
    max_steps = run.setting("trainer.max_steps")
    if not steps or max_steps is None:
        return None
    last, saved = max(steps), max(run.checkpoints, default=0)
    every = run.setting("trainer.save_interval", 0) or 0
    wanted = bool(run.setting("trainer.save_last", True)) or (every and max_steps % every == 0)
    if saved >= last or (last >= max_steps and not wanted):  # resumable, or finished with no final save asked
        return None
    half = f"; {', '.join(run.partial)} was left half-written" if run.partial else ""
    what = (f"finished {max_steps} steps, the newest complete checkpoint is step {saved}" if last >= max_steps else
            f"stopped (or still running) at step {last} of trainer.max_steps={max_steps}; the newest complete "
            f"checkpoint is " + (f"step {saved}" if saved else "none"))
    return Finding("no_final_checkpoint", last, what + half,
                   "read the end of the run's output and logs/ (a failed rank leaves its report there); "
                   f"re-run the same command to resume from step {saved}; a smaller trainer.save_interval loses less")


@dataclass(frozen=True)
class Rule:
    check: Callable[[Run], Finding | None]
    symptom: str
    needs: tuple[str, ...] = ()  # metrics it reads; "a|b": either
    trend: bool = False  # compares later steps with a baseline: needs BASELINE_STEPS + PERSIST_STEPS steps


RULES = {
    "nonfinite": Rule(nonfinite, "loss or grad norm NaN/inf", ("loss", "grad_norm")),
    "grad_norm_spike": Rule(grad_norm_spike, "grad norm spike", ("grad_norm",)),
    "loss_spike": Rule(loss_spike, "loss spike", ("loss",)),
    "kl_growth": Rule(kl_growth, "KL growing without bound", ("kl/mean",), trend=True),
    "reward_hacking": Rule(reward_hacking, "reward rising while response length blows up or collapses",
                           ("reward/mean", "response_length/mean"), trend=True),
    "token_prob_error": Rule(token_prob_error, "trainer/engine mismatch above NeMo-RL's gate",
                             ("mismatch/token_prob_error",)),
    "refit_check": Rule(refit_check, "refit check failed", ("refit/bitwise",)),
    "clip_fraction": Rule(clip_fraction, "clip fraction persistently high", ("policy/clip_fraction",), trend=True),
    "ended_falling": Rule(ended_falling, "fraction of ended samples falling", ("fraction/ended",), trend=True),
    "unscored": Rule(unscored, "unscored samples", ("fraction/unscored",)),
    "service_trouble": Rule(service_trouble, "service timeouts and retries"),
    "throughput_drop": Rule(throughput_drop, "throughput dropped mid-run", ("|".join(THROUGHPUT_KEYS),), trend=True),
    "no_final_checkpoint": Rule(no_final_checkpoint, "stopped without a final checkpoint"),
}
SYMPTOMS = {name: rule.symptom for name, rule in RULES.items()}


def unchecked(run: Run) -> dict[str, str]:
    """rule -> why it could not look (a metric not logged, too few steps, no config or logs)."""
    out, enough = {}, BASELINE_STEPS + PERSIST_STEPS
    for name, rule in RULES.items():
        logged = {need: max(len(series(run.rows, k)) for k in need.split("|")) for need in rule.needs}
        missing = [need for need, n in logged.items() if n == 0]
        if missing:
            out[name] = f"no {', '.join(missing)}"
        elif rule.trend and min(logged.values()) < enough:
            out[name] = f"fewer than {enough} logged steps"
    if not run.config:
        out["no_final_checkpoint"] = "no config.yaml"
    if not run.logs:
        out["service_trouble"] = "no log files in the run directory"
    return out


# ---- the command ---------------------------------------------------------------------------------------
def load_run(run_dir) -> Run:
    run_dir = checked_run_dir(run_dir)
    return Run(read_rows(run_dir / "metrics.jsonl"), read_config(run_dir), read_logs(run_dir),
               *read_checkpoints(run_dir / "checkpoints"))


def findings_of(run: Run) -> list[Finding]:
    """Every rule's finding, by the step it started (log findings of unknown step last)."""
    return sorted((f for rule in RULES.values() if (f := rule.check(run)) is not None),
                  key=lambda f: (f.step is None, f.step or 0))


def diagnose(run_dir) -> list[Finding]:
    return findings_of(load_run(run_dir))


def main(run_dirs: list[str]) -> int:
    """Print each readable run's findings: 0 = healthy, 1 = a symptom was found. The first run directory
    that could not be read is raised once the others are printed (its `error:` line, exit code 1)."""
    code, unreadable = 0, None
    for run_dir in run_dirs:
        try:
            run = load_run(run_dir)
        except RunDirError as e:
            unreadable = unreadable or e
            continue
        findings, last = findings_of(run), max((r["step"] for r in run.rows), default=0)
        print(f"{run_dir}:")
        for finding in findings:
            print(f"  {finding}")
        if not findings:
            print(f"  no known failure symptoms in {last} steps")
        skipped = unchecked(run)
        if skipped:
            print("  not checked: " + "; ".join(f"{name} ({why})" for name, why in skipped.items()))
        code = max(code, 1 if findings else 0)
    if unreadable is not None:
        raise unreadable
    return code
