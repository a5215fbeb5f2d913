"""The PyTriton servers end to end, sharing session-scoped servers started together:
a reward server at TP=1 and at TP=2, a critic co-hosting a 2-attribute reward model, a verifier.

Scores served equal in-process scores of the same checkpoint; TP=2 equals TP=1; critic_train
changes the values (reporting its clip fraction and seconds) and critic_save (at an actor step)
reloads identically; critic_load and a restart with resume_step return bitwise to a saved step, and a
step never saved is refused while the critic serves on; bad requests get errors while the server
keeps serving; a port clash is not mistaken for readiness; a server killed mid-traffic costs errors
(never 0 rewards) and the same client works again once it is back; everything stops cleanly."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import numpy as np
import psutil
import pytest

from aligner.launch.zygote import ZygoteProcess, zygote_socket
from tests.server_workers import free_port_block, make_reward_checkpoint, triton_model_dirs, triton_scratch_dirs

pytestmark = pytest.mark.dist
pytest.importorskip("pytriton", reason="the servers need the serve extra: pip install 'aligner[serve]'")
if not __import__("sysconfig").get_config_var("Py_ENABLE_SHARED"):
    pytest.skip("PyTriton's backend needs a Python with a shared libpython", allow_module_level=True)
WEIGHTS, MEAN, STD = [0.5, -1.0], 0.1, 2.0


@pytest.fixture(scope="session")
def world(tiny_assets, tmp_path_factory):
    from aligner.data.synthetic import arithmetic_problems
    from aligner.data.tokenizer import load_tokenizer
    from aligner.servers.process import ServerProcess

    root = tmp_path_factory.mktemp("servers")
    model_dirs_before = triton_model_dirs()
    tokenizer_dir = tiny_assets / "tokenizer"
    rm1 = make_reward_checkpoint(root / "rm1", tokenizer_dir, 1, seed=1)
    rm2 = make_reward_checkpoint(root / "rm2", tokenizer_dir, 2, seed=2, attributes=["helpfulness", "correctness"])
    tokenizer = load_tokenizer(tokenizer_dir)
    texts = [f"<|user|>What is {p['question'][:-1]}?<eos><|assistant|>{p['answer']}" + " and more" * (i % 7)
             for i, p in enumerate(arithmetic_problems(40, seed=5))]
    # The TP=2 server's rendezvous port is drawn here too: drawn by its own launcher, it could land on
    # a port another server of this fixture has not bound yet (seen once: the critic's HTTP port).
    ports = {name: free_port_block() for name in ("reward", "reward_tp2", "critic", "verifier", "tp2_rendezvous")}
    assert len({p + i for p in ports.values() for i in range(3)}) == 3 * len(ports), ports
    servers = {
        "reward": ServerProcess("reward", [f"checkpoint={rm1}", "server.max_batch_size=16"], root / "reward",
                                port=ports["reward"]),
        "reward_tp2": ServerProcess("reward", [f"checkpoint={rm1}", "parallel.tensor_model_parallel_size=2",
                                               "launcher.nproc_per_node=2", "server.forward_micro_batch_size=3",
                                               f"launcher.master_port={ports['tp2_rendezvous']}"],
                                    root / "reward_tp2", port=ports["reward_tp2"]),
        "critic": ServerProcess("critic", [f"checkpoint={rm1}", f"reward_checkpoint={rm2}",
                                           f"reward.attribute_weights=[{WEIGHTS[0]},{WEIGHTS[1]}]",
                                           "reward.standardize=true", f"reward.mean={MEAN}", f"reward.std={STD}",
                                           "optim.lr=1e-4", "trainer.global_batch_size=16"],
                                root / "critic", port=ports["critic"]),
        "verifier": ServerProcess("verifier", [f"tokenizer={tokenizer_dir}"], root / "verifier", port=ports["verifier"]),
    }
    start = time.monotonic()
    for server in servers.values():
        server.start()
    try:
        for server in servers.values():
            server.wait_ready(240)
    except Exception:
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            server.stop()
        raise
    print(f"4 servers ready in {time.monotonic() - start:.1f} s")
    world = {"root": root, "rm1": rm1, "rm2": rm2, "tokenizer": tokenizer, "texts": texts,
             "sequences": [tokenizer(t + "<eos>", add_special_tokens=False)["input_ids"] for t in texts],
             "ports": ports, "servers": servers, "model_dirs_before": model_dirs_before, "leaked": set()}
    yield world
    for server in world["servers"].values():
        server.terminate()
    for server in world["servers"].values():
        server.stop()


@pytest.fixture(scope="session")
def reference(world):
    from aligner.models.scoring import score_checkpoint

    return {"rm1": score_checkpoint(world["rm1"], world["sequences"]).numpy(),
            "rm2": score_checkpoint(world["rm2"], world["sequences"]).numpy()}


def reward_client(world, name="reward", **kwargs):
    from aligner.servers.client import RewardClient

    return RewardClient(port=world["ports"][name], **{"max_rows": 16, **kwargs})


# ---- scores -------------------------------------------------------------------------------------------
def test_reward_server_equals_in_process_scores(world, reference):
    with reward_client(world) as client:
        futures = [client.score(world["sequences"]), client.score(texts=[t + "<eos>" for t in world["texts"]])]
        tokens, texts = [f.result(timeout=60) for f in futures]
    assert tokens.scored.all() and texts.scored.all()
    diff = np.abs(tokens.values - reference["rm1"]).max()
    print(f"reward server vs in-process: max |diff| {diff:.2e}")
    assert diff < 1e-5
    assert np.array_equal(texts.values, tokens.values)  # text is tokenized as in RM training


def test_tp2_server_equals_tp1(world, reference):
    with reward_client(world, "reward_tp2", max_rows=64) as client:
        scores = client.score(world["sequences"]).result(timeout=60)
    diff = np.abs(scores.values - reference["rm1"]).max()
    print(f"TP=2 reward server vs TP=1 in-process: max |diff| {diff:.2e}")
    assert scores.scored.all() and diff < 1e-4


def test_sigusr1_does_not_stop_a_server(world, reference):
    """SIGUSR1 is Slurm's time-limit warning to training ranks (slurm/train.sbatch); a server that gets
    it, alone or through its launcher (TP=2, which passes it on to its ranks), keeps serving."""
    before = {name: sorted(world["servers"][name].alive()) for name in ("reward", "reward_tp2")}
    for name in before:
        world["servers"][name].proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    for name, pids in before.items():
        assert sorted(world["servers"][name].alive()) == pids, name
        with reward_client(world, name) as client:
            scores = client.score(world["sequences"]).result(timeout=60)
        assert scores.scored.all() and np.abs(scores.values - reference["rm1"]).max() < 1e-4, name


def test_concurrent_futures_come_back_in_order(world, reference):
    with reward_client(world, max_rows=4, workers=8) as client:
        futures = [client.score(world["sequences"][i:i + 5]) for i in range(0, 40, 5)]
        values = np.concatenate([f.result(timeout=60).values for f in futures])
    assert np.abs(values - reference["rm1"]).max() < 1e-5


@pytest.mark.parametrize("inputs, reason", [
    ({"tokens": np.zeros((1, 4), np.int32), "sequence_lengths": np.ones((1, 1), np.int64)}, "data-type is 'INT32'"),
    ({"tokens": np.zeros((1, 300), np.int64), "sequence_lengths": np.ones((1, 1), np.int64)}, "max_seq_length=256"),
    ({"tokens": np.zeros((65, 4), np.int64), "sequence_lengths": np.ones((65, 1), np.int64)}, "batch-size must be <= 64"),
    ({"tokens": np.array([[5, 600, 7]]), "sequence_lengths": np.array([[3]])}, "token id 600 at tokens[0, 1]"),
    ({"tokens": np.array([[5, 6, 7]]), "sequence_lengths": np.array([[4]])}, "sequence_lengths[0]=4 is outside"),
    ({"tokens": np.array([[5, 6, 7]])}, "'sequence_lengths' is missing"),
    ({"sentences": np.array([[b"\xff\xfe"]], dtype=object)}, "sentences[0] is not valid UTF-8"),
], ids=["dtype", "too_long", "too_many_rows", "out_of_vocab", "bad_length", "missing_input", "bad_utf8"])
def test_bad_requests_get_errors_and_the_server_keeps_serving(world, reference, inputs, reason):
    from aligner.servers.client import CallFailed, EndpointClient

    # the TP=2 server: a refused request must not leave the follower rank waiting mid-broadcast
    endpoint = EndpointClient("127.0.0.1", world["ports"]["reward_tp2"], "reward_model", retries=0)
    with pytest.raises(CallFailed) as failed:
        endpoint.call(inputs)
    assert failed.value.status == "error" and reason in failed.value.message, failed.value.message
    good = endpoint.call({"tokens": np.array([world["sequences"][0]]),
                          "sequence_lengths": np.array([[len(world["sequences"][0])]])})
    assert abs(good["rewards"][0, 0] - reference["rm1"][0, 0]) < 1e-4


def test_client_samples_without_tokens_are_errors_not_zeros(world):
    with reward_client(world, max_rows=2) as client:
        scores = client.score([[5, 6], [], [7, 8], [9]]).result(timeout=60)
    assert scores.scored.tolist() == [True, False, True, True]
    assert np.isnan(scores.values[~scores.scored]).all() and "no tokens" in next(iter(scores.failures.values()))


# ---- critic -------------------------------------------------------------------------------------------
def _served_rm2(raw):
    return ((raw @ np.array(WEIGHTS, dtype=np.float32)[:, None]) - MEAN) / STD


def test_critic_cohosts_the_reward_model(world, reference):
    from aligner.servers.client import CriticClient

    seqs = world["sequences"][:12]
    with reward_client(world, "critic") as rewards, CriticClient(port=world["ports"]["critic"]) as critic:
        before = critic.values(seqs).result(timeout=60)
        served = rewards.score(seqs).result(timeout=60)
        after = critic.values(seqs).result(timeout=60)  # the critic's weights came back intact
    assert np.abs(served.values - _served_rm2(reference["rm2"][:12])).max() < 1e-5
    assert np.abs(before.rewards - served.values).max() < 1e-5  # the values reply carries them (PPO reads them)
    assert all(np.array_equal(a.value, b.value) for a, b in zip(before.results, after.results))
    # initialised from rm1 (one output, so its head too): the value at the last token is rm1's reward
    last = np.array([r.value[-1] for r in before.results])
    assert np.abs(last - reference["rm1"][:12, 0]).max() < 1e-5


def test_model_stubs_run_at_real_time_priority(world):
    """Every thread of the critic's model stubs at SCHED_RR where the OS permits (root, as in CI), so that their
    health threads answer within Triton's 1-s window beside busy ranks (servers/triton.py); tritonserver itself and
    the server's own compute keep the ordinary policy."""
    from aligner.servers.triton import STUB_PRIORITY

    serving = psutil.Process(world["servers"]["critic"].serving_pid)
    relays = [p for p in serving.children(recursive=True) if p.name().startswith(("tritonserver", "triton_python"))]
    stubs = [p for p in relays if p.name().startswith("triton_python")]
    assert len(relays) == 1 + 5 and len(stubs) == 5  # a stub per model: critic_infer/train/save/load, reward_model
    policy = (os.SCHED_RR, STUB_PRIORITY) if os.geteuid() == 0 else (os.SCHED_OTHER, 0)
    threads = [t.id for p in stubs for t in p.threads()]
    assert {(os.sched_getscheduler(t), os.sched_getparam(t).sched_priority) for t in threads} == {policy}
    others = [t.id for p in (serving, *set(relays) - set(stubs)) for t in p.threads()]
    assert {os.sched_getscheduler(t) for t in others} == {os.SCHED_OTHER}


def test_tritonserver_skips_the_config_completion_stubs(world):
    """tritonserver runs with --strict-model-config=true (servers/triton.py): no stub is launched per model only to
    complete its config, which PyTriton has written whole; the endpoints above and below still answer."""
    serving = psutil.Process(world["servers"]["critic"].serving_pid)
    [server] = [p for p in serving.children(recursive=True) if p.name().startswith("tritonserver")]
    args = server.cmdline()
    assert args[args.index("--strict-model-config") + 1] == "true"


def test_critic_infer_also_returns_rewards(world, reference):
    from aligner.servers.client import EndpointClient
    from aligner.servers.protocol import pad_token_rows

    tokens, lengths = pad_token_rows(world["sequences"][:5])
    out = EndpointClient("127.0.0.1", world["ports"]["critic"], "critic_infer").call(
        {"tokens": tokens, "sequence_lengths": lengths})
    past_end = np.arange(tokens.shape[1])[None, :] >= lengths
    assert out["values"].shape == tokens.shape and (out["values"][past_end] == 0).all()
    assert np.abs(out["rewards"] - _served_rm2(reference["rm2"][:5])).max() < 1e-5


def _train_batch(world):
    from aligner.servers.protocol import pad_token_rows

    seqs = world["sequences"][:24]  # two optimizer steps of the critic's global batch 16
    tokens, lengths = pad_token_rows(seqs)
    return seqs, tokens, (np.arange(tokens.shape[1])[None, :] < lengths).astype(np.float32)


def _same_values(a, b) -> bool:
    return all(x.ok and y.ok and np.array_equal(x.value, y.value) for x, y in zip(a.results, b.results, strict=True))


def test_critic_train_changes_values_and_save_reloads_identically(world):
    import json

    from aligner.models.scoring import score_checkpoint
    from aligner.servers.client import CriticClient

    seqs, tokens, mask = _train_batch(world)
    with CriticClient(port=world["ports"]["critic"]) as critic:
        before = critic.values(seqs).result(timeout=60)
        start = np.nan_to_num(before.padded(tokens.shape[1]))
        trained = critic.train(tokens, start + 1.0, start, mask).result(timeout=120)
        served = critic.values(seqs).result(timeout=60)
        step = critic.save(7).result(timeout=120)
    after = served.padded(tokens.shape[1])
    assert np.isfinite(trained.loss_mean) and trained.loss_mean > 0
    assert 0.0 <= trained.clip_fraction <= 1.0 and trained.seconds > 0 and before.seconds > 0
    moved = ((after - start)[mask > 0]).mean()
    print(f"critic_train: loss {trained.loss_mean:.4f}, clip fraction {trained.clip_fraction:.3f}, "
          f"{trained.seconds:.2f} s on the server; mean value change {moved:+.4f} towards returns (+1)")
    assert moved > 0.01  # two optimizer steps (24 rows, global batch 16) towards the returns
    assert step == 7
    saved = world["root"] / "critic" / "checkpoints" / "step_000007"
    state = json.loads((saved / "aligner.json").read_text())["trainer_state"]
    assert (state["actor_step"], state["updates"]) == (7, 2)
    reloaded = score_checkpoint(saved, seqs, per_token=True)
    diff = np.abs(reloaded.numpy()[mask > 0] - after[mask > 0]).max()
    print(f"saved critic reloaded in-process vs served: max |diff| {diff:.2e}")
    assert diff < 1e-5
    world["critic_step_7"] = served


def test_critic_load_returns_bitwise_to_a_saved_step(world):
    from aligner.servers.client import CallFailed, CriticClient

    at_7 = world.get("critic_step_7") or pytest.skip("needs the step-7 checkpoint of the test above")
    seqs, tokens, mask = _train_batch(world)
    values = np.nan_to_num(at_7.padded(tokens.shape[1]))
    with CriticClient(port=world["ports"]["critic"]) as critic:
        # previous values 10 above the current ones and returns 10 below: every token's value moves
        # more than loss_clip=0.2 from its previous value, away from the return, so each one is clipped
        far = critic.train(tokens, values - 10.0, values + 10.0, mask).result(timeout=120)
        assert critic.save(9).result(timeout=120) == 9
        at_9 = critic.values(seqs).result(timeout=60)
        assert critic.load(7).result(timeout=120) == 7
        back = critic.values(seqs).result(timeout=60)
        # the optimizer, LR schedule and update count came back too: the same request trains the same way
        again = critic.train(tokens, values - 10.0, values + 10.0, mask).result(timeout=120)
        at_9_again = critic.values(seqs).result(timeout=60)
        with pytest.raises(CallFailed) as missing:
            critic.load(99).result(timeout=60)
        still = critic.values(seqs).result(timeout=60)
    assert far.clip_fraction == 1.0 and not _same_values(at_9, at_7)
    assert _same_values(back, at_7)
    assert again.loss_mean == far.loss_mean and _same_values(at_9_again, at_9)
    message = missing.value.message
    print(f"critic_load(99): {message}")
    assert missing.value.status == "error" and message.count("\n") == 0
    assert (f"no critic checkpoint for actor step 99 in {world['root'] / 'critic' / 'checkpoints'} "
            f"(steps saved there: 7, 9)") in message
    assert _same_values(still, at_9)  # the server serves on, unchanged


def test_a_restarted_critic_resumes_from_resume_step(world):
    """The critic saved step 9 after step 7; an actor resuming from step 7 starts it at step 7."""
    from aligner.servers.client import CriticClient
    from aligner.servers.process import ServerProcess

    at_7 = world.get("critic_step_7") or pytest.skip("needs the step-7 checkpoint of the tests above")
    server = world["servers"]["critic"]
    assert server.stop() == 0
    restarted = ServerProcess(server.kind, [*server.overrides, "resume_step=7"], server.run_dir, port=server.port)
    world["servers"]["critic"] = restarted.start().wait_ready(240)
    with CriticClient(port=world["ports"]["critic"]) as critic:
        assert _same_values(critic.values(world["sequences"][:24]).result(timeout=60), at_7)


def test_critic_train_rejects_mismatched_shapes(world):
    from aligner.servers.client import CallFailed, CriticClient

    with CriticClient(port=world["ports"]["critic"]) as critic:
        tokens = np.ones((2, 5), np.int64)
        with pytest.raises(CallFailed, match="'returns' must have shape"):
            critic.train(tokens, np.zeros((2, 4)), np.zeros((2, 5)), np.ones((2, 5))).result(timeout=60)


# ---- verifier -----------------------------------------------------------------------------------------
def test_verifier_checks_arithmetic_answers(world):
    from aligner.servers.client import RewardClient

    responses = ["19", "The answer is 19.", "I think it is 18", "no idea", "12+7=19"]
    with RewardClient(port=world["ports"]["verifier"], model="verifier") as verifier:
        verifier.wait_ready(10)
        by_text = verifier.score(texts=responses, answers=["19"] * 5).result(timeout=30)
        ids = [world["tokenizer"](r, add_special_tokens=False)["input_ids"] for r in responses]
        by_tokens = verifier.score(ids, answers=["19"] * 5).result(timeout=30)
    assert by_text.values[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert np.array_equal(by_tokens.values, by_text.values)


# ---- readiness, failures, shutdown ----------------------------------------------------------------------
def test_port_clash_is_not_mistaken_for_readiness(world, tmp_path):
    from aligner.servers.process import ServerFailed, ServerProcess

    clash = ServerProcess("reward", [f"checkpoint={world['rm1']}"], tmp_path / "clash", port=world["ports"]["reward"])
    with pytest.raises(ServerFailed, match="is not available"):
        clash.start().wait_ready(60)
    assert not clash.alive()


def test_killed_server_costs_errors_not_zeros_and_the_client_reconnects(world, reference):
    from aligner.servers.process import ServerProcess

    server = world["servers"]["reward"]
    victim = [p.cmdline() for p in psutil.Process(server.serving_pid).children() if "tritonserver" in p.name()]
    world["leaked"] |= {arg.rsplit("/workspace", 1)[0] for cmd in victim for arg in cmd if "/aligner-triton-" in arg}
    seqs = world["sequences"]
    stop, futures = threading.Event(), []
    with reward_client(world, max_rows=8, workers=4, retries=2, backoff_s=0.2) as client:
        def traffic():  # an actor scoring batch after batch
            while not stop.is_set():
                futures.append(client.score(seqs))
                futures[-1].result(timeout=120)

        senders = [threading.Thread(target=traffic) for _ in range(2)]
        for sender in senders:
            sender.start()
        time.sleep(1.0)
        server.kill()  # the whole process tree, mid-traffic
        time.sleep(0.5)
        stop.set()
        for sender in senders:
            sender.join()
        outcomes = [f.result(timeout=120) for f in futures]
        for scores in outcomes:
            ok = scores.scored
            assert np.abs(scores.values[ok] - reference["rm1"][ok]).max(initial=0) < 1e-5  # scored means right
            assert np.isnan(scores.values[~ok]).all()
        failed = sum(int((~s.scored).sum()) for s in outcomes)
        assert failed > 0 and all(s.results[i].status in ("error", "timeout") for s in outcomes
                                  for i in np.flatnonzero(~s.scored))
        print(f"kill: {len(outcomes)} batches in flight or after, {failed} samples reported unscored")
        restarted = ServerProcess(server.kind, server.overrides, server.run_dir, port=server.port)
        world["servers"]["reward"] = restarted.start().wait_ready(120)
        again = client.score(seqs).result(timeout=60)  # the same client, new connections
    assert again.scored.all() and np.abs(again.values - reference["rm1"]).max() < 1e-5


@pytest.mark.solo  # /tmp is the machine's: no other test's servers start or die meanwhile
def test_servers_stop_cleanly_and_leave_nothing_behind(world):
    import shutil

    # forked from the session's zygote when one runs (ALIGNER_TEST_ZYGOTE=0: fresh), and clean either way
    assert {isinstance(server.proc, ZygoteProcess) for server in world["servers"].values()} == {bool(zygote_socket())}
    model_dirs = triton_model_dirs()  # now, with the servers up
    ours = set()  # the running servers' workspaces: their tritonserver runs from there
    for server in world["servers"].values():
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                ours |= {part.split("/workspace/")[0] for part in child.cmdline() if "/aligner-triton-" in part}
    start = time.monotonic()
    for server in world["servers"].values():
        server.terminate()  # all at once
    for name, server in world["servers"].items():
        code = server.stop()
        print(f"{name}: stopped with code {code} after {time.monotonic() - start:.1f} s")
        assert code == 0, server.log_tail()
        assert not server.alive(), (name, server.alive())
    assert ours and not ours & triton_scratch_dirs(), ours & triton_scratch_dirs()  # each removed its workspace
    # and the servers stopped by SIGTERM left no model dir in /tmp (the SIGKILLed one did, F5: removed here)
    assert triton_model_dirs() - model_dirs == set(), triton_model_dirs() - model_dirs
    leftovers = world["leaked"] | (triton_model_dirs() - world["model_dirs_before"])
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
