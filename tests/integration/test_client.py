"""The servers' client without a real server: readiness errors, retries with backoff on refused and
dropped connections (only idempotent endpoints are resent: critic_save/load, not critic_train), server
refusals, timeouts, and typed per-sample results that never turn a failure into a 0 reward."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from aligner.servers.client import CallFailed, CriticClient, EndpointClient, RewardClient, SampleResult, \
    ServerUnavailable, Values, _server_reason


class FakeServer:
    """Accepts HTTP connections on 127.0.0.1 and, per request: closes the connection ("close"),
    never answers ("hang"), or answers 400 with a Triton-style error ("refuse": a bad input;
    "unknown": the model is not loaded)."""

    def __init__(self, behaviour: str):
        self.behaviour, self.requests, self.held = behaviour, 0, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _read_request(self, conn) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                self._read_request(conn)
            except OSError:
                continue
            self.requests += 1
            if self.behaviour == "close":
                conn.close()
            elif self.behaviour == "hang":
                self.held.append(conn)
            else:
                error = ("Request for unknown model: 'reward_model' is not found" if self.behaviour == "unknown" else
                         "[request id: <id_unknown>] inference input 'tokens' data-type is 'INT32', but model "
                         "'reward_model' expects 'INT64'")
                body = json.dumps({"error": error}).encode()
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def fake(request):
    server = FakeServer(request.param)
    yield server
    server.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.solo
def test_wait_ready_names_host_port_and_endpoint():
    port = closed_port()
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match=f"no reward server at 127.0.0.1:{port} after 0.5 s .*'reward_model'"):
        EndpointClient("127.0.0.1", port, "reward_model").wait_ready(0.5)
    assert time.monotonic() - start < 3
    with pytest.raises(ServerUnavailable, match="no critic server"):
        CriticClient(port=port).wait_ready(0.2)


def test_refused_connections_are_retried_with_backoff_then_reported_unscored():
    with RewardClient(port=closed_port(), retries=2, backoff_s=0.1, max_rows=2) as client:
        start = time.monotonic()
        scores = client.score([[1, 2], [3], [4, 5, 6]]).result(timeout=30)
    assert time.monotonic() - start >= 0.1 + 0.2  # two retries: 0.1 s then 0.2 s
    assert not scores.scored.any() and np.isnan(scores.values).all()
    assert all("after 3 attempts" in m and "ConnectionRefusedError" in m for m in scores.failures.values())


@pytest.mark.parametrize("fake", ["close"], indirect=True)
def test_dropped_connections_are_resent_only_when_idempotent(fake):
    scores = RewardClient(port=fake.port, retries=2, backoff_s=0.05).score([[1, 2]]).result(timeout=30)
    assert fake.requests == 3 and not scores.scored.any()
    assert "after 3 attempts (HTTPConnectionClosed" in scores.failures[0]  # geventhttpclient's own exception
    fake.requests = 0
    critic = CriticClient(port=fake.port, retries=2, backoff_s=0.05)
    with pytest.raises(CallFailed, match="not resent"):
        critic.train(np.ones((1, 3)), np.zeros((1, 3)), np.zeros((1, 3)), np.ones((1, 3))).result(timeout=30)
    assert fake.requests == 1
    for call in (critic.save, critic.load):  # saving or loading a step twice leaves the same state
        fake.requests = 0
        with pytest.raises(CallFailed, match="after 3 attempts"):
            call(7).result(timeout=30)
        assert fake.requests == 3
    critic.close()


@pytest.mark.parametrize("fake", ["refuse"], indirect=True)
def test_server_refusals_are_errors_and_not_retried(fake):
    with RewardClient(port=fake.port, retries=3, backoff_s=0.05) as client:
        scores = client.score([[1, 2], [3, 4]]).result(timeout=30)
    assert fake.requests == 1 and scores.results[0].status == "error"
    assert "data-type is 'INT32'" in scores.failures[0] and np.isnan(scores.values).all()


@pytest.mark.parametrize("fake", ["unknown"], indirect=True)
def test_a_server_still_loading_its_models_is_retried(fake):
    with RewardClient(port=fake.port, retries=2, backoff_s=0.05) as client:
        scores = client.score([[1, 2]]).result(timeout=30)
    assert fake.requests == 3 and "is not found" in scores.failures[0]


@pytest.mark.parametrize("fake", ["hang"], indirect=True)
@pytest.mark.solo
def test_slow_answers_are_timeouts(fake):
    with RewardClient(port=fake.port, timeout_s=0.5, retries=3) as client:
        start = time.monotonic()
        scores = client.score([[1, 2]]).result(timeout=30)
    assert scores.results[0].status == "timeout" and fake.requests == 1
    assert time.monotonic() - start < 5


def test_server_reason_is_the_raised_exception_line():
    text = ("Failed to process the request(s) for model 'reward_model_0_0', message: TritonModelException: Model execute "
            "error: Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
            "aligner.servers.protocol.RequestError: token id 600 at tokens[0, 1] is outside the vocabulary [0, 512)\n\n"
            "At:\n  /tmp/folder/1/model.py(501): execute\n")
    assert _server_reason(text) == ("aligner.servers.protocol.RequestError: token id 600 at tokens[0, 1] is outside "
                                    "the vocabulary [0, 512)")
    assert _server_reason("[request id: <id_unknown>] inference request batch-size must be <= 64") == \
        "[request id: <id_unknown>] inference request batch-size must be <= 64"


def test_values_padding_marks_unscored_samples():
    values = Values((SampleResult("ok", np.array([1.0, 2.0])), SampleResult("error", None, "boom")), seconds=0.5)
    assert values.scored.tolist() == [True, False] and values.seconds == 0.5
    padded = values.padded(3)
    assert padded[0, :2].tolist() == [1.0, 2.0] and np.isnan(padded[0, 2]) and np.isnan(padded[1]).all()


def test_score_arguments_are_checked():
    client = RewardClient(port=closed_port())
    with pytest.raises(ValueError, match="either token-id sequences or texts"):
        client.score()
    with pytest.raises(ValueError, match="2 answers for 1 samples"):
        client.score(texts=["a"], answers=["1", "2"])
    assert client.score([]).result(timeout=5).values.shape == (0, 1)
    client.close()
