"""`aligner train ppo` end to end through the CLI, with the critic service it starts itself (embedded): a
stalled service is waited for and changes nothing, a SIGKILLed one stops the trainer with
exit 75 and one line naming it, the re-run resumes both sides and its steps equal an uninterrupted run's,
a TP=2 or CP=2 actor's first step equals one process's, and a wrong service layout is refused before anything
starts. The Service's retries are checked without a service."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from aligner.algorithms.online.ppo import Service
from aligner.servers.client import OK, TIMEOUT, SampleResult, Values
from tests.conftest import (REPO, REWARDS, critic_service_processes, job_field, read_metrics, requeued_job_log,
                            run_cli, signal_usr1, sigusr1_stop_step, start_cli)

KEYS = ("reward/mean", "loss", "grad_norm", "kl/mean", "value/loss", "returns/mean", "value/explained_variance",
        "advantages/mean", "response_length/mean")
# two optimizer steps a step (16 prompts, global batch 8): the second meets old log-probs, a KL and clipping
SIX_STEPS = ("trainer.max_steps=6", "trainer.save_interval=2", "algorithm.kl.target=0.05", "algorithm.kl.horizon=100",
             "trainer.global_batch_size=8")


def ppo_args(assets, root, run_dir, *extra):
    sft = root / "sft/checkpoints/step_000040"
    return ("train", "ppo", f"run_dir={run_dir}", f"data.train_path={root / 'target.jsonl'}",
            f"tokenizer.path={assets / 'tokenizer'}", f"model.pretrained={sft}", f"critic.checkpoint={sft}",
            f"reward.functions=[{REWARDS}:emits_target]", "reward.workers=1", "algorithm.prompts_per_step=16",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "generation.batch_size=8",
            "sampling.max_new_tokens=4", "optim.lr=1e-3", "optim.min_lr=1e-3", "trainer.val_interval=0",
            "critic.trainer.global_batch_size=16", "critic.optim.lr=1e-3", "critic.optim.min_lr=1e-3",
            "logging.progress=false", "logging.tensorboard=false", *extra)


def ppo(assets, root, run_dir, *extra):
    result = run_cli(*ppo_args(assets, root, run_dir, *extra))
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def straight(tiny_assets, rl_assets, tmp_path_factory):
    """Six PPO steps, uninterrupted, checkpoints every two: the reference of the fault test."""
    return ppo(tiny_assets, rl_assets, tmp_path_factory.mktemp("ppo_straight"), *SIX_STEPS)


def _signal_service(run_dir, sig) -> None:
    victims = critic_service_processes(run_dir)
    assert victims
    for p in victims:
        os.kill(p.pid, sig)


@pytest.mark.solo
def test_a_stalled_service_changes_nothing_a_killed_one_stops_the_run_and_the_rerun_resumes(
        tiny_assets, rl_assets, straight, tmp_path):
    """Once step 2's checkpoints are complete the service stalls for 3 s (SIGSTOP, SIGCONT): the run waits,
    and requests that failed meanwhile are asked again, so no sample is masked. Once step 4's are complete it
    is SIGKILLed: the trainer exits 75 with one line naming the service, and re-running the command resumes
    both sides; every step, stalled or resumed, equals the uninterrupted run's."""
    run_dir = tmp_path / "run"
    # the deadline covers the 3-s stall three times over, and is how long the run then waits for the killed service
    args = ppo_args(tiny_assets, rl_assets, run_dir, *SIX_STEPS, "critic.timeout_s=10")
    process = start_cli(*args)

    def wait_for(step):
        deadline = time.monotonic() + 300
        while not (run_dir / f"checkpoints/step_{step:06d}/COMPLETE").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.05)

    wait_for(2)
    _signal_service(run_dir, signal.SIGSTOP)
    time.sleep(3)
    _signal_service(run_dir, signal.SIGCONT)
    wait_for(4)
    _signal_service(run_dir, signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 75, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "critic service at 127.0.0.1:" in line]
    assert lines and "stopped answering" in lines[-1] and "re-run the same command to resume" in lines[-1]
    assert "Traceback" not in stderr
    resumed = ppo(tiny_assets, rl_assets, run_dir, *SIX_STEPS, "critic.timeout_s=10")
    assert [m["step"] for m in resumed] == list(range(1, 7))  # the killed run's lines, then the re-run's
    for ours, ref in zip(resumed, straight):
        for key in KEYS + ("kl/coef", "fraction/unscored"):
            assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (ours["step"], key)
    assert all(m["fraction/unscored"] == 0.0 for m in resumed)  # no sample was lost to the stall


def _collect(timeout_s: float, answers: list[Values], ready: bool, reward_url: str | None = None):
    """Service.await_values_and_scores of two samples (prompt [5, 6], response [7, 8]) whose values
    request got answers[0]; each time it is asked again the critic gives the next answer (the last one
    repeated) and its readiness is `ready`. No service runs."""
    service = Service("127.0.0.1:9", reward_url, timeout_s, 60.0, None)
    again = iter(answers[1:])

    def answered(answer) -> Future:
        future = Future()
        future.set_result(answer)
        return future

    service.critic.values = lambda sequences: answered(next(again, answers[-1]))
    service.critic.infer_endpoint.is_ready = lambda: ready
    sample = SimpleNamespace(prompt=SimpleNamespace(ids=[5, 6]), response_ids=[7, 8],
                             sequence=lambda: ([5, 6, 7, 8], None))
    try:
        return service.await_values_and_scores([(2, answered(answers[0]), None, None)], [sample, sample])
    finally:
        service.close()


def test_the_cohosted_reward_model_scores_come_with_the_values():
    """reward.checkpoint co-hosted by the critic service (reward URL = critic URL): its scores are read
    from the values reply, and no reward_model request is sent beside it."""
    values = tuple(SampleResult(OK, np.arange(4, dtype=np.float32)) for _ in range(2))
    _, scores, _ = _collect(5.0, [Values(values, 0.1, np.array([[0.25], [-1.5]], dtype=np.float32))], ready=True,
                            reward_url="127.0.0.1:9")
    assert scores == [0.25, -1.5]
    service = Service("127.0.0.1:9", "127.0.0.1:9", 5.0, 60.0, None)
    try:
        service.critic.values = lambda sequences: "values"
        service.reward.score = lambda sequences: pytest.fail("the reward model asked twice")
        sample = SimpleNamespace(sequence=lambda: ([5, 6, 7, 8], None))
        assert service.submit([sample], tokenizer=None) == (1, "values", None, None)
        service.reward.score = lambda sequences: "scores"  # validation asks for scores only
        assert service.submit([sample], tokenizer=None, values=False) == (1, None, "scores", None)
    finally:
        service.close()


@pytest.mark.solo
def test_a_failed_request_is_asked_again_until_the_deadline_then_masked_or_the_service_is_lost():
    ok = Values(tuple(SampleResult(OK, np.arange(4, dtype=np.float32)) for _ in range(2)))
    failed = Values((SampleResult(TIMEOUT, None, "no answer within 30 s"),) * 2)
    values, scores, _ = _collect(5.0, [failed, failed, ok], ready=True)  # a stall it recovers from: nothing lost
    assert scores == [0.0, 0.0] and values.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    started = time.monotonic()
    _, scores, _ = _collect(1.0, [failed], ready=True)  # ready, but never answering these samples: masked
    assert scores == [None, None] and time.monotonic() - started >= 1.0
    started = time.monotonic()  # not ready: lost at once (the client has retried the request for timeout_s)
    with pytest.raises(ConnectionError, match="critic service at 127.0.0.1:9 stopped answering: no critic values, "
                                              "not ready within critic.timeout_s=1 s"):
        _collect(1.0, [failed], ready=False)
    assert time.monotonic() - started < 0.5


def test_the_kl_coefficient_adapts(straight):
    coefs = [m["kl/coef"] for m in straight]
    assert coefs[0] == 0.02 and len(set(coefs)) > 1  # it moved, from the configured start


def test_the_embedded_service_is_configured_from_every_critic_setting():
    """The overrides the trainer starts its service with compose into `aligner serve critic`'s config with the
    critic's optimizer (every key: the distributed optimizer was once left out), trainer and layout."""
    from dataclasses import fields

    from aligner.algorithms.online.ppo import embedded_overrides
    from aligner.config import load_config
    from aligner.config.load import compose_config
    from aligner.config.schema import OptimConfig

    cfg = load_config("ppo", ["data.train_path=p.jsonl", "tokenizer.path=tok", "reward.checkpoint=rm",
                              "critic.optim.distributed_optimizer=true", "critic.optim.lr=3e-4",
                              "critic.optim.adam_beta2=0.99", "critic.launcher.nproc_per_node=2",
                              "critic.parallel.tensor_model_parallel_size=2", "critic.trainer.micro_batch_size=2"],
                      world_size=1)
    serve = compose_config("serve_critic", embedded_overrides(cfg, step=0))
    for f in fields(OptimConfig):
        if f.name != "decay_steps":  # the service's own: its trainer.max_steps
            assert serve.optim[f.name] == cfg.critic.optim[f.name], f.name
    assert serve.optim.distributed_optimizer is True and serve.optim.lr == 3e-4
    assert (serve.launcher.nproc_per_node, serve.parallel.tensor_model_parallel_size,
            serve.trainer.micro_batch_size, serve.checkpoint) == (2, 2, 2, "rm")


def test_a_wrong_service_layout_is_refused_before_start(tiny_assets, rl_assets, tmp_path):
    result = run_cli(*ppo_args(tiny_assets, rl_assets, tmp_path / "run", "critic.parallel.tensor_model_parallel_size=3",
                               "critic.launcher.nproc_per_node=3"))
    assert result.returncode == 2 and "critic.parallel.tensor_model_parallel_size=3" in result.stderr
    result = run_cli(*ppo_args(tiny_assets, rl_assets, tmp_path / "run", "critic.launcher.nproc_per_node=3",
                               "critic.parallel.tensor_model_parallel_size=2"))
    assert result.returncode == 2 and "critic.launcher.nproc_per_node=3" in result.stderr
    result = run_cli(*ppo_args(tiny_assets, rl_assets, tmp_path / "run", "critic.url=nohost"))
    assert result.returncode == 2 and "critic.url must be host:port" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_first_step_with_a_tp2_actor_a_tp2_service_and_engine_log_probs_matches_one_process(
        tiny_assets, rl_assets, straight, tmp_path):
    """A TP=2 actor (two ranks of the embedded launcher) and a TP=2 critic service (its own two ranks), the
    old log-probs from the engine (algorithm.old_logprobs=engine, TRL's way: no old-log-prob forward; the fp32
    CPU engine's log-probs equal the trainer's to float rounding): the first step's samples are the
    one-process trainer-forward run's, its losses, values and gradients equal to float tolerance, and no
    old-log-prob forward ran. One run for both properties (each was a PPO run of its own)."""
    metrics = ppo(tiny_assets, rl_assets, tmp_path / "run", *SIX_STEPS[2:], "trainer.max_steps=1",
                  "trainer.save_interval=0", "algorithm.old_logprobs=engine",
                  "launcher.nproc_per_node=2", "model.tensor_model_parallel_size=2",
                  "critic.launcher.nproc_per_node=2", "critic.parallel.tensor_model_parallel_size=2")
    first, ref = metrics[-1], straight[0]
    assert first["step"] == ref["step"] == 1
    for key in ("reward/mean", "response_length/mean", "fraction/ended"):
        assert first[key] == ref[key], key  # the same samples: seeds per sample, not per rank
    for key in ("loss", "grad_norm", "kl/mean", "value/mean", "returns/mean", "advantages/std", "value/loss",
                "value/explained_variance", "policy/clip_fraction"):
        assert first[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    assert first["timing/logprobs_s"] < 0.1 * ref["timing/logprobs_s"]  # no forward at all


def test_first_step_with_a_cp2_actor_or_a_rollout_worker_matches_one_process(tiny_assets, rl_assets, straight,
                                                                             tmp_path):
    """A CP=2 actor (its CP ranks generate as two replicas, its passes split each sequence over them) and a
    one-rank service: the first step equals the one-process run's (`straight`), two optimizer steps of it (old
    log-probs, a KL, clipping). A separate rollout worker at lag 0 (generation.placement=separate) gives it
    bitwise."""
    cp, separate = (ppo(tiny_assets, rl_assets, tmp_path / name, *SIX_STEPS[2:], "trainer.max_steps=1",
                        "trainer.save_interval=0", *layout)[-1]
                    for name, layout in (("cp2", ["launcher.nproc_per_node=2", "model.context_parallel_size=2"]),
                                         ("separate", ["generation.placement=separate"])))
    one = straight[0]
    assert separate["async/lag"] == 0.0
    for key in KEYS + ("policy/clip_fraction", "entropy/mean"):
        assert separate[key] == one[key], key
    assert one["optimizer_steps"] == 2 and one["advantages/std"] > 0
    for key in ("reward/mean", "response_length/mean", "fraction/ended"):
        assert cp[key] == one[key], key  # the same samples: seeds per sample, not per rank
    for key in ("loss", "grad_norm", "kl/mean", "entropy/mean", "value/mean", "returns/mean", "advantages/std",
                "value/loss", "policy/clip_fraction"):
        assert cp[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key


# ------------------------------------------------------------------ slurm/ppo.sbatch on the local Slurm cluster
ONE_TASK = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=1"]


@pytest.fixture()
def slurm_env(slurm):
    """aligner from this checkout's environment on PATH, as a user's job finds it; the tests' reward module."""
    return {**slurm, "PATH": f"{os.path.dirname(sys.executable)}:{slurm['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO)}


def _submit_hetjob(env, out, args) -> str:
    """slurm/ppo.sbatch with one task on one node for each component (service : actor)."""
    submit = subprocess.run(["sbatch", "--parsable", f"--output={out}", *ONE_TASK, ":", *ONE_TASK, "slurm/ppo.sbatch",
                             *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert submit.returncode == 0, submit.stderr
    return submit.stdout.strip().split(";")[0]


def _job_log(out) -> str:
    return out.read_text() if out.exists() else "(no job output yet)"


def test_the_hetjob_stops_on_usr1_requeues_and_both_sides_resume_exactly(tiny_assets, rl_assets, straight,
                                                                         slurm_env, tmp_path):
    """Component 0 serves the critic, component 1 trains; SIGUSR1 after step 3 reaches both: the actor
    saves the critic and itself at one step and exits 75, the script requeues the job, and the requeued
    job resumes both sides and ends with the uninterrupted embedded run's metrics."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    args = ppo_args(tiny_assets, rl_assets, run_dir, *SIX_STEPS, "critic.timeout_s=60")[2:]
    job = _submit_hetjob(slurm_env, out, args)
    log = requeued_job_log(slurm_env, job, run_dir, out, 3, lambda: signal_usr1(slurm_env, job))
    assert "start 1; service on node1, actor on node2" in log and "start 2;" in log, log
    assert "stopped at a checkpoint; requeueing job" in log, log
    stop_step = sigusr1_stop_step(log)
    assert 3 <= stop_step < 6
    steps = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    assert f"step_{stop_step:06d}" in steps(run_dir / "checkpoints") == steps(run_dir / "critic/checkpoints")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 7))  # every step once, none lost
    for ours, ref in zip(metrics, straight):
        for key in KEYS + ("kl/coef",):
            assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (ours["step"], key)


def test_a_hetjob_too_small_for_the_service_fails_before_anything_starts(tiny_assets, rl_assets, slurm_env,
                                                                         tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = _submit_hetjob(slurm_env, out, ppo_args(tiny_assets, rl_assets, run_dir,
                                                  "critic.parallel.tensor_model_parallel_size=2")[2:])
    deadline = time.monotonic() + 120
    while (state := job_field(slurm_env, job, "JobState")) not in ("FAILED", "COMPLETED"):
        assert time.monotonic() < deadline, (state, _job_log(out))
        time.sleep(0.5)
    log = _job_log(out)
    assert state == "FAILED" and "error: slurm/ppo.sbatch" in log, log
    assert "the service (component 0) has 1 tasks" in log and "Traceback" not in log, log
    assert not run_dir.exists()
