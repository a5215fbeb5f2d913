"""The device acceptance kit (bench/accept.py, scripts/device/): its dry run on this CPU, so that the kit
cannot rot between loans of a GPU; `--only` reruns into an existing accept.json; a check past its time is
ended and recorded as cut by the budget; the manifest and size check of the files the kit carries
(scripts/device/manifest.py, on a temporary folder: no download). The model-FLOPs formula by hand:
tests/unit/test_accept_flops.py."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from bench.accept_checks import CHECKS
from tests.conftest import FRESH, REPO

# What each check may end as on a CPU host
DRY_STATUS = {"env": {"pass"}, "sft": {"pass"}, "checkpoint": {"pass"}, "grpo": {"pass"}, "reinforce": {"pass"},
              "generate": {"pass"}, "mfu": {"pass"}, "rl_async": {"pass"},
              "te": {"skipped"},  # no Transformer Engine: the local spec stands in for TE's
              "pytest_gpu": {"skipped"},
              "trl": {"pass", "skipped"},  # skipped without the TRL peer baseline's scripts or trl
              "ppo": {"pass", "skipped"}}  # skipped without PyTriton


def accept(*args: str, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/accept.py", "--dry-run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("accept")
    # the kit's 480 s budget is a GPU session's; here the dry run shares two cores with the rest of the suite
    result = accept("--out", str(root / "out"), "--work", str(root / "work"), "--commit", "abc123", "--budget", "1800")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root


def test_dry_run_records_every_check_with_its_figures(dry_run):
    report = json.loads((dry_run / "out" / "accept.json").read_text())
    assert report["dry_run"] is True and report["commit"] == "abc123" and report["device"] == "cpu (dry run)"
    assert list(report["checks"]) == list(CHECKS) == list(DRY_STATUS)
    for name, record in report["checks"].items():
        assert record["status"] in DRY_STATUS[name], (name, record)
        assert record["seconds"] > 0 and record["commit"] == "abc123", name
        if record["status"] == "pass":
            assert record["expected"] and record["measured"], name
        else:
            assert record["reason"], name
    c = {name: record["measured"] for name, record in report["checks"].items()}
    assert c["env"]["versions"]["megatron-core"].startswith("0.16") and c["env"]["doctor_exit"] == 0
    assert c["pytest_gpu"]["failed"] == 0 and c["pytest_gpu"]["skipped"] >= 1
    # the two "devices" are this CPU, so fp32 runs agree exactly; bf16 differs, within the gate
    assert c["sft"]["cpu_vs_cuda_fp32_max_rel"] == 0.0 and c["sft"]["packed_vs_padded_max_rel"] <= 1e-5
    assert 0.0 < c["sft"]["bf16_vs_fp32_max_rel"] <= 3e-2
    for resume in ("cpu_to_cuda", "cuda_to_cpu", "cuda_to_cuda"):  # CPU -> CPU resume is bitwise
        assert c["checkpoint"][resume]["max_rel"] == 0.0 and c["checkpoint"][resume]["first_step"] == 4
    te = report["checks"]["te"]
    assert "no CUDA device; transformer_engine: not installed" in te["reason"]
    assert c["te"]["spec_lines"] == ["layer spec: local (no CUDA device)"] and c["te"]["auto_uses_te"] is False
    assert c["te"]["spec"] == "local" and c["te"]["keys"]["spec_only"] == []
    for load in ("converted_into_spec", "local_checkpoint_into_spec", "spec_checkpoint_into_local",
                 "spec_checkpoint_resumed"):  # the same spec and device: weights and logits exact, no key astray
        assert c["te"][load] == {"weights_differ": [], "logits_rel": 0.0, "absent": [], "left_over": []}, load
    for rl in ("grpo", "reinforce"):
        assert c[rl]["finite"] and 1.0 <= c[rl]["token_prob_error_max"] <= 1.1 and c[rl]["doctor_exit"] == 0
    assert c["rl_async"]["lag"] == [0.0, 1.0, 1.0] and c["rl_async"]["finite"]  # a separate worker at lag 1
    assert all(0 < busy <= 1 for busy in c["rl_async"]["worker_busy"])
    assert c["generate"]["logits_rel_diff"] <= 5e-2
    assert [r["batch"] for r in c["generate"]["throughput"]] == [1, 4]
    assert all(r["aligner_tokens_per_s"] > 0 and r["transformers_tokens_per_s"] > 0
               for r in c["generate"]["throughput"])
    assert c["mfu"]["steps"] == 3 and c["mfu"]["tokens_per_s"] > 0 and c["mfu"]["plan"]["fits"] is True
    assert c["mfu"]["mfu"] == pytest.approx(c["mfu"]["tokens_per_s"] * c["mfu"]["flops_per_token"] / 50e9)
    log = (dry_run / "out" / "accept.log").read_text()
    assert all(f"===== {name}: " in log for name in CHECKS)


def test_only_reruns_the_named_checks_into_the_same_report(dry_run):
    path = dry_run / "out" / "accept.json"
    report = json.loads(path.read_text())
    report["checks"]["sft"]["kept"] = True
    report["checks"]["pytest_gpu"]["status"] = "fail"
    path.write_text(json.dumps(report))
    result = accept("--out", str(dry_run / "out"), "--work", str(dry_run / "work"), "--only", "pytest_gpu",
                    "--commit", "def456")
    assert result.returncode == 0, result.stderr[-3000:]
    rerun = json.loads(path.read_text())
    assert rerun["commit"] == "def456" and rerun["previous_commit"] == "abc123"
    assert rerun["checks"]["pytest_gpu"]["status"] == "skipped" and rerun["checks"]["pytest_gpu"]["commit"] == "def456"
    assert rerun["checks"]["sft"]["kept"] is True and rerun["checks"]["sft"]["commit"] == "abc123"
    assert list(rerun["checks"]) == list(CHECKS)


def test_a_check_past_its_time_is_ended_and_recorded_as_cut_by_the_budget(tmp_path):
    """sft on a fresh work directory needs ~40 s here; a budget of 21 s ends it (and the runs it started), and
    records it as ended by the budget (a run too short for it), not as a timeout of its own limit."""
    result = accept("--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--only", "sft", "--budget", "21",
                    env=FRESH)  # processes named by their command lines: not forked from the zygote
    assert result.returncode == 0  # not a failure of the code under test
    record = json.loads((tmp_path / "out" / "accept.json").read_text())["checks"]["sft"]
    assert record["status"] == "budget" and "21 s" in record["reason"] and 21 <= record["seconds"] < 40
    # the output of the commands it was waiting for, which it never got to print, is in its log
    log = (tmp_path / "work" / "logs" / "sft.log").read_text()
    assert re.search(r"--- run\d\d_(convert|train)\.(out|err) \(its last", log), log[-2000:]
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_on_the_device_the_kit_forks_from_its_own_zygote_once_a_forked_probe_passed(monkeypatch):
    """bench/accept_zygote.py, as the lent machine runs it (no zygote handed over): the probe forked from it ran its
    operation (here on the CPU), the checks' processes are then told to fork from it, and stopping it ends it and
    gives the caller back its environment."""
    from aligner.launch import zygote
    from bench.accept import end_tree
    from bench.accept_zygote import KitZygote

    for variable in (zygote.ZYGOTE_VARIABLE, "SLURM_JOB_ID"):
        monkeypatch.delenv(variable, raising=False)
    kit = KitZygote()
    try:
        assert kit.state == "used: probe: cpu 8 forked=True", kit.state
        assert zygote.zygote_socket() == str(kit.socket)
        forked = zygote.run([sys.executable, "-m", "bench.accept", "--probe"], cwd=REPO, env=dict(os.environ))
        assert forked.stdout.strip() == "probe: cpu 8 forked=True"
        # a check ended at its limit (end_tree) takes what it forked with it, not the zygote, whose folder starts
        # with the default work directory's path
        work = Path(tempfile.gettempdir()) / "aligner-accept"
        assert str(kit.folder).startswith(str(work))
        check = zygote.popen([sys.executable, "-m", "tests.zygote_child", "sleep", str(work / "runs")], cwd=REPO,
                             stdout=subprocess.PIPE, start_new_session=True)
        assert isinstance(check, zygote.ZygoteProcess) and check.stdout.readline()
        end_tree(check, work)
        assert check.returncode == -signal.SIGKILL and kit.process.poll() is None
        check.stdout.close()
    finally:
        kit.stop()
    assert kit.process.poll() is not None and zygote.ZYGOTE_VARIABLE not in os.environ and not kit.folder.exists()


def test_unknown_check_is_refused():
    result = accept("--only", "nope")
    assert result.returncode == 2 and "unknown check nope" in result.stderr


def test_manifest_lists_every_file_and_checks_each_call(tmp_path):
    folder = tmp_path / ".whl"
    (folder / "core").mkdir(parents=True)
    (folder / "ppo" / "sub").mkdir(parents=True)
    files = {"core/a.whl": b"a" * 1000, "ppo/b.tar.xz": b"b" * 3000, "ppo/sub/c.py": b"print()\n"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    limit = 3500 / 1024 ** 2  # MiB: the call core+ppo (4008 bytes) is over, core alone is not
    run = [sys.executable, "scripts/device/manifest.py", str(folder), "--call", "one=core", "--call", "two=core,ppo",
           "--limit-mib", str(limit)]
    result = subprocess.run(run, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 1 and "call two" in result.stdout and "OVER" in result.stdout.split("call two")[1]
    rows = [line.split("\t") for line in (folder / "MANIFEST.tsv").read_text().splitlines()[1:]]
    listed = {f"{g}/{p}": (int(n), digest) for g, p, n, digest in rows if g != "call"}
    assert listed == {name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items()}
    assert {p: int(n) for g, p, n, _ in rows if g == "call"} == {"one=core": 1000, "two=core,ppo": 4008}
    assert subprocess.run(run[:-1] + ["1"], cwd=REPO, capture_output=True).returncode == 0
    missing = subprocess.run(run[:3] + ["--call", "x=fp8"], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and "no group folder fp8" in missing.stderr
