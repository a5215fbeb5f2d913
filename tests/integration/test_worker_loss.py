"""A trainer that lost a rollout worker exits at once with 75, although its bridge still holds a weight broadcast
to the worker that will never complete: torch's gloo destructor would wait for it (up to the bridge's timeout,
an hour) at interpreter exit. Real processes on a gloo bridge; the peer stays alive and never reads, which holds
the broadcast as a lost worker's half-open connection did on the local Slurm cluster."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from aligner.runtime.ports import free_port

PEER = """
import sys, time
from aligner.runtime.collectives import Bridge
bridge = Bridge(sys.argv[1], 1, 2)
print("joined", flush=True)
time.sleep(120)
"""

TRAINER = """
import sys, torch
from aligner import errors
from aligner.errors import UserError
from aligner.generation.workers import RolloutWorkerLost
from aligner.runtime.collectives import Bridge
bridge = Bridge(sys.argv[1], 0, 2)
bridge.broadcast(torch.ones(16 * 2**20))  # 64 MiB: more than the sockets hold, and the peer never reads
kind = RolloutWorkerLost if sys.argv[2] == "lost" else UserError
try:
    raise kind("rollout worker 0 (TP rank 0, bridge rank 1) lost its connection")
except Exception as e:
    sys.exit(errors.handle(e))
"""


def start(script: str, *args: str, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, ALIGNER_LOG_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("ALIGNER_ERROR_FILE", None)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("kind", ["lost", "other"])
def test_a_lost_worker_ends_the_trainer_although_a_broadcast_to_it_is_pending(kind, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    peer = start(PEER, address, tmp_path=tmp_path)
    trainer = start(TRAINER, address, kind, tmp_path=tmp_path)
    try:
        if kind == "lost":
            _, stderr = trainer.communicate(timeout=60)  # the peer sleeps 120 s
            assert trainer.returncode == 75, stderr
            assert "error: rollout worker 0 (TP rank 0, bridge rank 1) lost its connection" in stderr, stderr
            assert peer.poll() is None  # the broadcast was still pending when the trainer ended
        else:  # the control: any other error's exit waits in the destructor until the peer is gone
            deadline = time.monotonic() + 60
            while "lost its connection" not in (line := trainer.stderr.readline()):
                assert line and time.monotonic() < deadline, "the control trainer never reported its error"
            time.sleep(1.0)
            assert trainer.poll() is None and peer.poll() is None
            peer.kill()
            assert trainer.wait(timeout=60) == 1
    finally:
        for process in (trainer, peer):
            process.kill()
            process.communicate()
