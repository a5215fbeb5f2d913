"""`aligner train ppo` end to end through the CLI, with the critic service it starts itself (embedded):
PPO learns a rewarded string, each actor checkpoint has the critic's of the same step, a SIGKILLed
service stops the trainer with exit 75 and one line naming it, the re-run resumes both sides and its
steps equal an uninterrupted run's, and a wrong service layout is refused before anything starts."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.conftest import read_metrics, run_cli, start_cli
from tests.test_rl_loop import REWARDS, rl_assets  # noqa: F401 - the module fixture, shared

KEYS = ("reward/mean", "loss", "grad_norm", "kl/mean", "value/loss", "returns/mean", "value/explained_variance",
        "advantages/mean", "response_length/mean")


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


def test_ppo_learns_a_rewarded_string(tiny_assets, rl_assets, tmp_path):
    """+1 for a response containing "7" (a reward function; the critic starts from the SFT model with a
    fresh value head, and lam=1 gives Monte-Carlo returns while it learns): PPO makes nearly every
    sample earn it within 50 steps, and the critic learns."""
    metrics = ppo(tiny_assets, rl_assets, tmp_path / "run", "trainer.max_steps=50", "algorithm.kl.coef=0.0",
                  "algorithm.lam=1.0", "trainer.save_interval=25")
    rewards = [m["reward/mean"] for m in metrics]
    print("reward/mean per step:", [round(r, 2) for r in rewards])
    assert rewards[0] < 0.3 and min(rewards[-5:]) >= 0.9
    assert metrics[-1]["value/explained_variance"] > metrics[0]["value/explained_variance"]
    for key in ("value/loss", "value/clip_fraction", "returns/mean", "kl/coef", "timing/critic_wait_s",
                "timing/critic_train_s", "timing/critic_train_server_s", "timing/critic_infer_server_s"):
        assert key in metrics[-1], key
    steps = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    assert steps(tmp_path / "run/checkpoints") == steps(tmp_path / "run/critic/checkpoints") \
        == ["step_000025", "step_000050"]
    assert not _service_processes(tmp_path / "run")  # stopped at the end


def _service_processes(run_dir) -> list[psutil.Process]:
    marker = f"run_dir={run_dir / 'critic'}"
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in (p.info["cmdline"] or [])):
            found += [p, *p.children(recursive=True)]
    return found


@pytest.fixture(scope="module")
def straight(tiny_assets, rl_assets, tmp_path_factory):
    """Six PPO steps, uninterrupted, checkpoints every two: the reference of the resume test."""
    return ppo(tiny_assets, rl_assets, tmp_path_factory.mktemp("ppo_straight"), "trainer.max_steps=6",
               "trainer.save_interval=2", "algorithm.kl.target=0.05", "algorithm.kl.horizon=100")


def _signal_service(run_dir, sig) -> None:
    victims = _service_processes(run_dir)
    assert victims
    for p in victims:
        os.kill(p.pid, sig)


def test_a_killed_service_stops_the_run_with_exit_75_and_the_rerun_resumes(tiny_assets, rl_assets, straight,
                                                                             tmp_path):
    """Once step 2's checkpoints are complete the service is SIGKILLed: the trainer exits 75 with one line
    naming the service, and re-running the command resumes both sides; every step equals the
    uninterrupted run's."""
    run_dir = tmp_path / "run"
    args = ppo_args(tiny_assets, rl_assets, run_dir, "trainer.max_steps=6", "trainer.save_interval=2",
                    "algorithm.kl.target=0.05", "algorithm.kl.horizon=100", "critic.timeout_s=30")
    process = start_cli(*args)
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints/step_000002/COMPLETE").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    _signal_service(run_dir, signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 75, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "critic service at 127.0.0.1:" in line]
    assert lines and "stopped answering" in lines[-1] and "re-run the same command to resume" in lines[-1]
    assert "Traceback" not in stderr
    resumed = ppo(tiny_assets, rl_assets, run_dir, "trainer.max_steps=6", "trainer.save_interval=2",
                  "algorithm.kl.target=0.05", "algorithm.kl.horizon=100", "critic.timeout_s=30")
    assert [m["step"] for m in resumed] == list(range(1, 7))  # the killed run's lines, then the re-run's
    for ours, ref in zip(resumed, straight):
        for key in KEYS + ("kl/coef",):
            assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (ours["step"], key)


def test_the_kl_coefficient_adapts(straight):
    coefs = [m["kl/coef"] for m in straight]
    assert coefs[0] == 0.02 and len(set(coefs)) > 1  # it moved, from the configured start


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
