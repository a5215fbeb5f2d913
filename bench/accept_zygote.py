"""The device kit's own zygote (aligner/launch/zygote.py), where no live one was handed to it: on the lent GPU
machine every check and every command a check runs (about 35 processes in a full run) would otherwise import torch,
megatron-core and transformers afresh, ~10 s each out of the run's few minutes.

The kit waits a bounded time for the zygote's imports, then forks one probe from it that runs a tensor operation on
the device (CUDA where there is one): only if the probe passes, forked, do the checks fork from it (ALIGNER_ZYGOTE
is set for them). A zygote that could not hand a working GPU to its forks costs the probe, not the
run; one that is not ready in time is not used. Its state goes into accept.json (`zygote`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aligner.launch import zygote

REPO = Path(__file__).resolve().parent.parent
READY_WITHIN_S = 30.0  # the longest the kit waits for the zygote's imports (~10 s on the lent machines)
PROBE_WITHIN_S = 20.0  # its forked probe: CUDA's start-up and one operation (a few seconds)


def probe() -> int:
    """`python -m bench.accept --probe`: one operation on this process's device; says whether it was forked."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    total = float((torch.ones(4, device=device) * 2).sum())
    print(f"probe: {device} {total:.0f} forked={zygote.forked_here()}", flush=True)
    return 0 if total == 8.0 else 1


class KitZygote:
    """Started on the lent machine (the dry run runs forked from the test suite's zygote, or fresh)."""

    def __init__(self):
        self.process = None
        self.before = os.environ.get(zygote.ZYGOTE_VARIABLE)
        if zygote.zygote_socket() is not None:
            self.state = "the caller's"
            return
        if "SLURM_JOB_ID" in os.environ:  # the zygote forks nothing under Slurm (aligner/launch/zygote.py)
            self.state = "none (under Slurm)"
            return
        self.folder = folder = Path(tempfile.mkdtemp(prefix="aligner-accept-zygote-"))
        self.socket = folder / "socket"
        self.process = zygote.start(folder, REPO, env={**os.environ, zygote.ZYGOTE_VARIABLE: ""})
        self.state = self._adopt(folder / "zygote.log")

    def _adopt(self, log: Path) -> str:
        deadline = time.monotonic() + READY_WITHIN_S
        while not self.socket.is_socket():
            if self.process.poll() is not None:
                return f"not used: it exited {self.process.returncode} while importing: {log.read_text()[-300:]}"
            if time.monotonic() > deadline:
                self.stop()
                return f"not used: not ready within {READY_WITHIN_S:.0f} s"
            time.sleep(0.1)
        env = {**os.environ, zygote.ZYGOTE_VARIABLE: str(self.socket)}
        try:
            result = zygote.run([sys.executable, "-m", "bench.accept", "--probe"], cwd=REPO, env=env,
                                timeout=PROBE_WITHIN_S)
        except subprocess.TimeoutExpired:
            result = subprocess.CompletedProcess([], -1, "", f"no answer within {PROBE_WITHIN_S:.0f} s")
        if result.returncode != 0 or "forked=True" not in result.stdout:
            self.stop()
            return f"not used: its forked probe failed (exit {result.returncode}): " + \
                (result.stdout + result.stderr)[-300:]
        os.environ[zygote.ZYGOTE_VARIABLE] = str(self.socket)  # the checks' processes, and what they run, fork
        return "used: " + result.stdout.strip()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.process is not None:  # what the caller had; the folder (its state keeps the log's tail)
            shutil.rmtree(self.folder, ignore_errors=True)
            if self.before is None:
                os.environ.pop(zygote.ZYGOTE_VARIABLE, None)
            else:
                os.environ[zygote.ZYGOTE_VARIABLE] = self.before
