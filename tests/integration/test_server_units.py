"""Server pieces without a server: request checks, the served reward's post-processing, the math
verifier, the critic's clip fraction by hand and its checkpoints by actor step, serve-config checks,
and the CLI refusing a busy port or a never-saved resume_step before loading anything."""
from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from aligner.servers import protocol
from aligner.servers.protocol import RequestError


# ---- protocol ------------------------------------------------------------------------------------------
def test_check_tokens_zeroes_padding_and_flattens_lengths():
    tokens, lengths = protocol.check_tokens({"tokens": np.array([[3, 4, 9], [5, 6, 7]]),
                                             "sequence_lengths": np.array([[2], [3]])},
                                            max_rows=4, max_length=8, vocab_size=10)
    assert tokens.tolist() == [[3, 4, 0], [5, 6, 7]] and lengths.tolist() == [2, 3]
    # ids past a row's length are ignored, even out of the vocabulary
    protocol.check_tokens({"tokens": np.array([[3, 99]]), "sequence_lengths": np.array([[1]])},
                          max_rows=4, max_length=8, vocab_size=10)


@pytest.mark.parametrize("inputs, message", [
    ({"tokens": np.array([[1, 2]], dtype=np.int32), "sequence_lengths": np.array([[2]])}, "must be int64, got int32"),
    ({"tokens": np.array([1, 2]), "sequence_lengths": np.array([[2]])}, "must have 2 dimensions"),
    ({"tokens": np.ones((5, 2), np.int64), "sequence_lengths": np.ones((5, 1), np.int64)}, "5 rows, more than"),
    ({"tokens": np.ones((1, 9), np.int64), "sequence_lengths": np.ones((1, 1), np.int64)}, "9 positions, more than"),
    ({"tokens": np.array([[1, 2]]), "sequence_lengths": np.array([[0]])}, "sequence_lengths[0]=0 is outside [1, 2]"),
    ({"tokens": np.array([[1, 2]]), "sequence_lengths": np.array([[2], [2]])}, "must have shape [1, 1]"),
    ({"tokens": np.array([[1, -2]]), "sequence_lengths": np.array([[2]])}, "token id -2 at tokens[0, 1]"),
    ({"sequence_lengths": np.array([[2]])}, "'tokens' is missing"),
])
def test_check_tokens_errors(inputs, message):
    with pytest.raises(RequestError) as e:
        protocol.check_tokens(inputs, max_rows=4, max_length=8, vocab_size=10)
    assert message in str(e.value)


def test_texts_round_trip_and_bad_utf8():
    array = protocol.text_array(["héllo", "1+1=2"])
    assert array.shape == (2, 1) and protocol.decode_texts({"sentences": array}, max_rows=4) == ["héllo", "1+1=2"]
    with pytest.raises(RequestError, match=r"sentences\[0\] is not valid UTF-8"):
        protocol.decode_texts({"sentences": np.array([[b"\xff"]], dtype=object)}, max_rows=4)
    with pytest.raises(RequestError, match="must be bytes"):
        protocol.decode_texts({"sentences": np.array([[1.0]])}, max_rows=4)


def test_pad_token_rows():
    tokens, lengths = protocol.pad_token_rows([[1, 2, 3], [4]], pad_to_multiple=4)
    assert tokens.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]] and lengths.tolist() == [[3], [1]]


def test_endpoints_keep_nemo_aligner_wire_names():
    reward = protocol.reward_endpoint(3)
    assert reward.name == "reward_model" and [t.name for t in reward.inputs] == ["tokens", "sequence_lengths", "sentences"]
    assert reward.outputs[0].name == "rewards" and reward.outputs[0].shape == (3,) and reward.outputs[0].dtype is np.float32
    assert reward.input("tokens").dtype is np.int64 and reward.input("sequence_lengths").shape == (1,)
    assert [t.name for t in protocol.CRITIC_TRAIN.inputs] == ["tokens", "returns", "prev_values", "mask"]
    assert [t.name for t in protocol.CRITIC_TRAIN.outputs] == ["loss_mean", "clip_fraction", "seconds"]
    assert not protocol.CRITIC_TRAIN.idempotent and not protocol.CRITIC_TRAIN.batched
    assert [t.name for t in protocol.critic_infer_endpoint(1).outputs] == ["values", "seconds", "rewards"]
    # checkpoints are named by the actor's step (NeMo-Aligner's critic_save sends a dummy_var instead)
    for endpoint in (protocol.CRITIC_SAVE, protocol.CRITIC_LOAD):
        assert endpoint.inputs == endpoint.outputs == (protocol.STEP,) and endpoint.idempotent
    assert protocol.STEP.dtype is np.int64 and protocol.STEP.shape == (1,)
    assert protocol.check_step({"step": np.array([7])}) == 7
    with pytest.raises(RequestError, match="one actor step >= 0"):
        protocol.check_step({"step": np.array([-1])})


# ---- served reward -------------------------------------------------------------------------------------
def test_reward_output_weights_then_standardises():
    from omegaconf import OmegaConf

    from aligner.config.schema import RewardOutputConfig
    from aligner.servers.common import RewardOutput

    cfg = OmegaConf.structured(RewardOutputConfig(attribute_weights=[1.0, 0.5], standardize=True, mean=1.0, std=2.0))
    output = RewardOutput(cfg, 2)
    assert output.num_outputs == 1
    assert output(np.array([[2.0, 4.0], [0.0, 0.0]])).tolist() == [[1.5], [-0.5]]
    plain = RewardOutput(OmegaConf.structured(RewardOutputConfig()), 3)
    assert plain.num_outputs == 3 and plain(np.ones((1, 3))).tolist() == [[1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="2 entries but the reward model has 3 outputs"):
        RewardOutput(cfg, 3)


# ---- the critic ------------------------------------------------------------------------------------------
def test_clip_fraction_by_hand():
    """clip 0.2. Token 0: V 1 moved past V_old 0 + 0.2, R 2: (0.2 - 2)^2 = 3.24 > (1 - 2)^2, clipped.
    Token 1: V = V_old: equal terms, not clipped. Token 2: clipped too, but masked out. Token 3: V 3
    moved past V_old 3.5 - 0.2, R 4: (3.3 - 4)^2 = 0.49 < (3 - 4)^2, not clipped. So 1 of 3 tokens;
    loss (3.24 + 1 + 1) / 2."""
    import torch

    from aligner.servers.critic_server import train_summary, value_loss

    local = {"prev_values": torch.tensor([[0.0, 2.0, 1.0, 3.5]]), "returns": torch.tensor([[2.0, 3.0, -1.0, 4.0]]),
             "mask": torch.tensor([[1.0, 1.0, 0.0, 1.0]])}
    loss, count, report = value_loss(0.2)(torch.tensor([[1.0, 2.0, 0.0, 3.0]])[..., None], local)
    assert (count.item(), report["clipped"].item()) == (3.0, 1.0)
    assert loss.item() == report["loss"].item() == pytest.approx(2.62)
    # over a request's steps, clip_fraction weighs each step by its tokens: (1 + 1) / (3 + 1), not (1/3 + 1) / 2
    loss_mean, clip_fraction = train_summary([{"loss": 2.62, "count": 3.0, "clipped": 1.0},
                                              {"loss": 0.5, "count": 1.0, "clipped": 1.0}])
    assert clip_fraction == 0.5 and loss_mean == pytest.approx((2.62 / 3 + 0.5) / 2)


def _fake_critic_checkpoint(path, actor_step, complete=True):
    path.mkdir(parents=True)
    (path / "aligner.json").write_text(json.dumps({"head": "value", "model": {"num_attention_heads": 4},
                                                   "trainer_state": {"actor_step": actor_step, "updates": 2}}))
    if complete:
        (path / "COMPLETE").write_text("")
    return path


def test_critic_checkpoints_are_found_by_the_actor_step_inside_them(tmp_path):
    from aligner.servers.config import critic_checkpoints, no_critic_checkpoint

    checkpoints = tmp_path / "checkpoints"
    assert critic_checkpoints(checkpoints) == {}
    _fake_critic_checkpoint(checkpoints / "step_000003", 3)
    _fake_critic_checkpoint(checkpoints / "renamed", 12)
    _fake_critic_checkpoint(checkpoints / "step_000020", 20, complete=False)  # a save that died
    _fake_critic_checkpoint(checkpoints / "step_000030.partial", 30)
    found = critic_checkpoints(checkpoints)
    assert found == {3: checkpoints / "step_000003", 12: checkpoints / "renamed"}
    assert no_critic_checkpoint(5, checkpoints, found) == \
        f"no critic checkpoint for actor step 5 in {checkpoints} (steps saved there: 3, 12)"


def test_cli_refuses_a_never_saved_resume_step_in_one_line(tmp_path):
    from tests.conftest import run_cli

    rm = _fake_checkpoint(tmp_path / "rm")
    for step in (3, 8):
        _fake_critic_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{step:06d}", step)
    result = run_cli("serve", "critic", f"checkpoint={rm}", f"run_dir={tmp_path / 'run'}", "resume_step=5", timeout=120)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: resume_step=5: no critic checkpoint for actor step 5 in "
                           f"{tmp_path / 'run' / 'checkpoints'} (steps saved there: 3, 8)")


# ---- verifiable rewards ------------------------------------------------------------------------------
@pytest.mark.parametrize("response, answer, arithmetic, math", [
    ("19", "19", 1.0, 1.0),
    ("The answer is 19.", "19", 1.0, 1.0),
    ("12+7=19", "19", 1.0, 1.0),
    ("19, no wait, 18", "19", 0.0, 0.0),
    ("no idea", "19", 0.0, 0.0),
    ("-4", "-4", 1.0, 1.0),
    ("1,234", "1234", 1.0, 1.0),
    ("so \\boxed{5/2} and then 7", "2.5", 0.0, 1.0),
    ("\\boxed{x+1}", "x + 1", 0.0, 1.0),
])
def test_math_rewards(response, answer, arithmetic, math):
    from aligner.rewards import get_verifier

    assert get_verifier("arithmetic")(response, answer) == arithmetic
    assert get_verifier("math")(response, answer) == math
    with pytest.raises(KeyError, match="unknown verifier 'nope'"):
        get_verifier("nope")


# ---- configs ------------------------------------------------------------------------------------------
def _fake_checkpoint(path, head="reward", outputs=1):
    path.mkdir(parents=True)
    (path / "aligner.json").write_text(json.dumps({"head": head, "model": {"num_attention_heads": 4},
                                                   "scalar_head": {"num_outputs": outputs}}))
    (path / "COMPLETE").write_text("")
    return path


@pytest.mark.parametrize("kind, overrides, message", [
    ("reward", ["server.port=70000"], "server.port=70000 is not a TCP port"),
    ("reward", ["server.grpc_port=5555"], "must differ"),
    ("reward", ["checkpoint=/nonexistent"], "checkpoint=/nonexistent does not exist"),
    ("reward", ["checkpoint=LM"], "has a 'lm' head, not a reward model's"),
    ("reward", ["reward.attribute_weights=[1,2,3]"], "has 3 entries, the reward model has 2 outputs"),
    ("reward", ["parallel.tensor_model_parallel_size=2"], "launcher.nproc_per_node=1 is not a multiple"),
    ("reward", ["parallel.tensor_model_parallel_size=3", "launcher.nproc_per_node=3"], "4 attention heads do not split"),
    ("reward", ["reward.standardize=true", "reward.std=0"], "reward.std must be > 0"),
    ("reward", ["server.max_batch_szie=3"], "max_batch_szie"),
    ("critic", ["checkpoint=null"], "the critic needs initial weights"),
    ("critic", ["trainer.global_batch_size=6", "trainer.micro_batch_size=4"], "must be a multiple of"),
    ("critic", ["reward_checkpoint=LM"], "is not a reward model"),
    ("critic", ["resume_step=4"], "resume_step=4: no critic checkpoint for actor step 4 in"),
    ("verifier", ["verifier=nope"], "verifier=nope is unknown"),
])
def test_serve_config_errors(tmp_path, kind, overrides, message):
    from aligner.errors import ConfigError
    from aligner.servers.config import load_serve_config

    rm, lm = _fake_checkpoint(tmp_path / "rm", outputs=2), _fake_checkpoint(tmp_path / "lm", head="lm")
    base = [] if kind == "verifier" else [f"checkpoint={rm}", f"run_dir={tmp_path / 'run'}"]
    overrides = [o.replace("=LM", f"={lm}") for o in overrides]
    with pytest.raises(ConfigError) as e:
        load_serve_config(kind, base + overrides)
    assert message in str(e.value)


def test_serve_config_defaults(tmp_path):
    from aligner.servers.config import load_serve_config

    cfg = load_serve_config("reward", [f"checkpoint={_fake_checkpoint(tmp_path / 'rm')}"])
    server = cfg.server
    assert (server.host, server.port, server.grpc_port, server.exit_timeout_s) == ("127.0.0.1", 5555, None, 10)
    assert load_serve_config("critic", [f"checkpoint={tmp_path / 'rm'}"]).server.port == 5567


def test_cli_refuses_a_busy_port_before_loading_a_model(tmp_path):
    from tests.conftest import run_cli

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        start = time.monotonic()
        result = run_cli("serve", "verifier", f"run_dir={tmp_path}", f"server.port={port}", timeout=60)
    assert result.returncode == 1 and f"port {port} on 127.0.0.1 is not available" in result.stderr
    assert time.monotonic() - start < 30
    assert run_cli("serve", "nope").returncode == 2


# ---- the collective forward behind every server, at PP=2 and DP=2 ------------------------------------------
@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 1)])  # two ranks: pipeline stages, or data-parallel replicas
def test_forward_rows_on_two_ranks_equals_one_process(tiny_assets, tmp_path, tp, pp):
    import torch

    from aligner.launch.local import launch
    from aligner.models.scoring import score_checkpoint
    from tests.server_workers import make_reward_checkpoint

    ckpt = make_reward_checkpoint(tmp_path / "rm", tiny_assets / "tokenizer", 2, seed=3)
    sequences = [[5 + (i * j) % 40 for j in range(3 + 4 * i)] for i in range(7)]  # 7 rows: uneven micro-batches of 3
    launch("tests.server_workers:forward_rows_rank", [str(ckpt), str(tp), str(pp), json.dumps(sequences),
                                                      str(tmp_path / "out.pt")], 2)
    served = torch.load(tmp_path / "out.pt")
    rewards, values = score_checkpoint(ckpt, sequences), score_checkpoint(ckpt, sequences, per_token=True)
    assert served["rewards"].shape == rewards.shape == (7, 2)
    assert (served["rewards"] - rewards).abs().max() < 1e-5
    assert (served["values"] - values).abs().max() < 1e-5
