"""`aligner doctor`'s rules (aligner/observe/doctor.py) on synthetic run directories: each rule fires on a run
that shows its symptom, at the step where it started, and stays silent on a healthy run (with the one-step
noise real runs have); its findings name their numbers; doctor.main prints one line per finding. The command
through the CLI and on a real GRPO run: tests/e2e/test_doctor.py."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from aligner.observe import doctor
from tests.conftest import REPO

STEPS = 30


def healthy_row(step: int) -> dict:
    """One RL step of a run going well, with a little step-to-step wobble."""
    wobble = 1 + 0.05 * ((step * 7) % 5 - 2)
    return {"step": step, "loss": 0.01 * wobble, "grad_norm": 0.5 * wobble, "lr": 1e-6, "optimizer_steps": 1.0,
            "reward/mean": 0.5 * wobble, "reward/std": 0.3, "kl/mean": 0.02 * min(step, 10) / 10 * wobble,
            "kl/coef": 0.04, "response_length/mean": 50 * wobble, "fraction/ended": 0.9, "fraction/unscored": 0.0,
            "policy/clip_fraction": 0.05 * wobble, "mismatch/token_prob_error": 1.0 + 0.01 * wobble,
            "refit/bitwise": 1.0, "refit/max_abs_diff": 0.0, "throughput/generated_tokens_per_s": 1000 * wobble,
            "timing/generate_s": 1.0 * wobble, "timing/train_s": 2.0, "timing/step_s": 3.0 * wobble}


def healthy_rows() -> list[dict]:
    rows = [{"step": 0, "val/reward/mean": 0.4}] + [healthy_row(s) for s in range(1, STEPS + 1)]
    rows[1]["throughput/generated_tokens_per_s"] = 300.0  # the first step warms up
    rows[9]["throughput/generated_tokens_per_s"] = 150.0  # lone dips and bumps: noise, not trends
    rows[12]["policy/clip_fraction"] = 0.6
    rows[14]["response_length/mean"] = 160.0
    rows[20]["fraction/ended"] = 0.3
    return rows


def add_checkpoint(run_dir, step: int, complete: bool = True) -> None:
    path = run_dir / "checkpoints" / (f"step_{step:06d}" + ("" if complete else ".partial"))
    path.mkdir(parents=True)
    (path / "aligner.json").write_text(json.dumps({"trainer_state": {"step": step}}))
    if complete:
        (path / "COMPLETE").write_text("")


def write_run(run_dir, rows, *, config: dict | None = None, logs: dict | None = None, checkpoints=(STEPS,)):
    """A run directory as `aligner train` leaves it: metrics.jsonl, config.yaml, logs, checkpoints."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = {"trainer": {"max_steps": STEPS, "save_interval": 0, "save_last": True}, "optim": {"clip_grad": 1.0},
            "sampling": {"max_new_tokens": 128}, "algorithm": {"kl": {"coef": 0.04}}}
    for group, values in (config or {}).items():
        base[group] = {**base.get(group, {}), **values}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(base))
    logs = {"logs/rank_1.log": "2026-01-01 00:00:00,000 INFO aligner.data.prompts: 200 prompts\n"} if logs is None else logs
    for name, text in logs.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    for step in checkpoints:
        add_checkpoint(run_dir, step)
    return run_dir


def changed(rows, key, value_of, start: int) -> list[dict]:
    """`rows` with `key` set to value_of(step) from `start` on."""
    return [{**r, key: value_of(r["step"])} if r["step"] >= start else r for r in rows]


def fired(run_dir) -> dict[str, doctor.Finding]:
    return {f.rule: f for f in doctor.diagnose(run_dir)}


def test_healthy_synthetic_run_shows_nothing_and_every_rule_looked(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", healthy_rows())
    assert doctor.diagnose(run_dir) == []
    assert doctor.unchecked(doctor.load_run(run_dir)) == {}
    assert doctor.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"no known failure symptoms in {STEPS} steps" in out and "not checked" not in out


SYMPTOMS = {  # rule -> (the rows showing it, the step it starts at)
    "nonfinite": (lambda rows: changed(changed(rows, "loss", lambda s: math.nan, 12), "grad_norm",
                                       lambda s: math.inf, 14), 12),
    "grad_norm_spike": (lambda rows: changed(rows, "grad_norm", lambda s: 40.0 if s == 15 else 0.5, 15), 15),
    "kl_growth": (lambda rows: changed(rows, "kl/mean", lambda s: 0.01 * 1.3 ** s, 1), 9),  # 0.1 at step 9
    "reward_hacking": (lambda rows: changed(changed(rows, "response_length/mean", lambda s: 150.0, 12),
                                            "reward/mean", lambda s: 0.9, 12), 12),
    "token_prob_error": (lambda rows: changed(rows, "mismatch/token_prob_error",
                                              lambda s: 1.15 if s in (20, 25) else 1.0, 20), 20),
    "refit_check": (lambda rows: changed(changed(rows, "refit/bitwise", lambda s: 0.0, 7),
                                         "refit/max_abs_diff", lambda s: 0.01, 7), 7),
    "clip_fraction": (lambda rows: changed(rows, "policy/clip_fraction", lambda s: 0.4, 10), 10),
    "ended_falling": (lambda rows: changed(rows, "fraction/ended", lambda s: 0.5, 16), 16),
    "unscored": (lambda rows: changed(rows, "fraction/unscored", lambda s: 0.25 if s in (4, 9) else 0.0, 4), 4),
    "throughput_drop": (lambda rows: changed(changed(rows, "throughput/generated_tokens_per_s", lambda s: 300.0, 20),
                                             "timing/generate_s", lambda s: 3.3, 20), 20),
}


@pytest.mark.parametrize("rule", sorted(SYMPTOMS))
def test_each_metrics_rule_fires_at_the_step_its_symptom_started(tmp_path, rule):
    make, step = SYMPTOMS[rule]
    found = fired(write_run(tmp_path / "run", make(healthy_rows())))
    assert set(found) == {rule}, found
    assert found[rule].step == step and found[rule].seen and found[rule].advice


def test_findings_name_their_numbers(tmp_path):
    found = fired(write_run(tmp_path / "a", SYMPTOMS["throughput_drop"][0](healthy_rows())))
    assert "timing/generate_s grew 3.3x" in found["throughput_drop"].seen  # the phase that slowed
    found = fired(write_run(tmp_path / "b", SYMPTOMS["token_prob_error"][0](healthy_rows())))
    assert "1.15 > 1.1" in found["token_prob_error"].seen and "2 of 30 steps" in found["token_prob_error"].seen
    # asynchronous RL: lagged steps train an older policy's samples on purpose; only lag-0 steps are judged
    lagged = changed(SYMPTOMS["token_prob_error"][0](healthy_rows()), "async/lag", lambda s: 0.0 if s == 1 else 1.0, 1)
    assert "token_prob_error" not in fired(write_run(tmp_path / "c", lagged))
    assert "token_prob_error" in fired(write_run(tmp_path / "d", changed(lagged, "mismatch/token_prob_error",
                                                                         lambda s: 1.2 if s == 1 else 1.0, 1)))


def test_unscored_quotes_the_log_line_that_says_why(tmp_path):
    line = ("2026-01-01 00:00:05,000 WARNING aligner.rewards.scoring: 2 reward function call(s) could not score "
            "their sample; the first: math: ValueError")
    found = fired(write_run(tmp_path / "run", SYMPTOMS["unscored"][0](healthy_rows()), logs={"train.log": line}))
    assert "could not score their sample" in found["unscored"].seen


def test_loss_spike_on_a_supervised_run_but_not_an_rl_surrogate_loss(tmp_path):
    sft = [{"step": s, "loss": 2.0 - 0.01 * s, "grad_norm": 0.5, "lr": 1e-5, "throughput/tokens_per_s": 5000.0}
           for s in range(1, STEPS + 1)]
    found = fired(write_run(tmp_path / "sft", changed(sft, "loss", lambda s: 6.0 if s == 18 else 1.8, 18)))
    assert set(found) == {"loss_spike"} and found["loss_spike"].step == 18
    rl = changed(healthy_rows(), "loss", lambda s: 0.5 if s == 18 else 0.01, 18)  # +/- surrogate: no level to keep
    assert fired(write_run(tmp_path / "rl", rl)) == {}


def test_silent_on_what_normal_runs_do(tmp_path):
    # an RL step with no update (every sample unscored) logs grad_norm NaN; sparse rewards give 0-norm steps
    # and then normal ones: neither is a numerical failure or a spike while the norm stays under clip_grad
    rows = changed(healthy_rows(), "grad_norm", lambda s: 0.0 if s < 10 else 0.8, 1)
    rows[5].update({"grad_norm": math.nan, "optimizer_steps": 0.0})
    assert set(fired(write_run(tmp_path / "a", rows))) == set()
    tiny = changed(healthy_rows(), "grad_norm", lambda s: 0.4 if s == 12 else 0.001, 1)  # 400x, under clip_grad
    assert set(fired(write_run(tmp_path / "tiny", tiny))) == set()
    # a KL that rose and settled is not growing without bound; length blowing up with a flat reward is no hacking
    settled = changed(healthy_rows(), "kl/mean", lambda s: 0.3 * min(s, 8) / 8, 1)
    assert fired(write_run(tmp_path / "b", settled)) == {}
    flat = changed(changed(healthy_rows(), "response_length/mean", lambda s: 150.0, 12), "reward/mean", lambda s: 0.5, 1)
    assert "reward_hacking" not in fired(write_run(tmp_path / "c", flat))


def test_service_retries_and_timeouts_in_the_logs(tmp_path):
    retries = "".join(f"2026-01-01 00:01:3{i},000 WARNING aligner.servers.client: critic_infer at 127.0.0.1:5000: "
                      f"ConnectionRefusedError (attempt {i + 1} of 4)\n" for i in range(3))
    timeout = ("2026-01-01 00:02:10,000 WARNING aligner.algorithms.online.ppo: critic_infer failed for 8 of 32 samples "
               "(critic_infer at 127.0.0.1:5000 gave no answer within 60 s); asking again\n")
    found = fired(write_run(tmp_path / "run", healthy_rows(), logs={"train.log": retries + timeout}))
    assert set(found) == {"service_trouble"}
    trouble = found["service_trouble"]
    # the logs name no step: the finding says `step ?` and quotes the first line, with its time
    assert trouble.step is None and str(trouble).startswith("step ?: service timeouts and retries — ")
    assert "4 retried request(s), 1 timeout line(s)" in trouble.seen and "train.log" in trouble.seen
    assert "2026-01-01 00:01:30,000" in trouble.seen


def test_a_lost_service_names_the_step_it_stopped_in(tmp_path):
    line = ("aligner train ppo: no critic server at 127.0.0.1:5000 after 300 s; stopped during step 7: the last "
            "checkpoint is consistent, re-run the same command to resume")
    run_dir = write_run(tmp_path / "run", healthy_rows()[:7], logs={"train.log": line}, checkpoints=(5,),
                        config={"trainer": {"save_interval": 5}})
    found = fired(run_dir)
    assert found["service_trouble"].step == 7 and "service lost" in found["service_trouble"].seen
    assert found["no_final_checkpoint"].step == 6  # logged step 6, checkpoint 5: step 6 is lost


@pytest.mark.parametrize("case", ["stopped_early", "final_save_half_written", "finished_without_save_asked",
                                  "stopped_at_a_checkpoint"])
def test_a_run_that_stopped_without_a_final_checkpoint(tmp_path, case):
    rows = healthy_rows()
    config = {"trainer": {"max_steps": 50, "save_interval": 10}}
    run_dir = tmp_path / "run"
    if case == "stopped_early":
        write_run(run_dir, rows, config=config, checkpoints=(10, 20))
    elif case == "final_save_half_written":
        write_run(run_dir, rows, checkpoints=(20,))
        add_checkpoint(run_dir, STEPS, complete=False)
    elif case == "finished_without_save_asked":
        write_run(run_dir, rows, config={"trainer": {"save_last": False}}, checkpoints=())
    else:
        write_run(run_dir, rows, config=config, checkpoints=(10, 20, 30))
    found = fired(run_dir)
    if case in ("finished_without_save_asked", "stopped_at_a_checkpoint"):
        assert found == {}
        return
    assert set(found) == {"no_final_checkpoint"} and found["no_final_checkpoint"].step == STEPS
    seen = found["no_final_checkpoint"].seen
    assert "newest complete checkpoint is step 20" in seen
    assert ("step_000030.partial was left half-written" in seen) == (case == "final_save_half_written")


def test_main_prints_one_line_per_finding_and_returns_1(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", SYMPTOMS["ended_falling"][0](healthy_rows()))
    assert doctor.main([str(run_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    finding = [line for line in out if line.strip().startswith("step ")]
    assert len(finding) == 1 and finding[0].strip().startswith("step 16: fraction of ended samples falling — ")
    assert "; try: " in finding[0]


def test_doctor_imports_no_torch():
    code = "import sys, aligner.observe.doctor; assert not {'torch', 'megatron'} & set(sys.modules), 'torch'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
