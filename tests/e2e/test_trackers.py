"""Experiment trackers (logging.wandb.*, logging.mlflow.*) driven by real SFT runs through the CLI: W&B in
offline mode (its run files read back), MLflow on a file: store (read back with MlflowClient). Each gets
the steps, keys and values of metrics.jsonl, from rank 0 only; a resumed run continues the same tracker
runs without sending a step twice. No test needs the network."""
import json
import struct
import sys

import pytest
from omegaconf import OmegaConf

from aligner.config.schema import SFTRunConfig
from aligner.config.validate import validate_trackers
from aligner.errors import ConfigError
from aligner.observe.trackers import open_trackers
from tests.conftest import assert_cli_ok, read_metrics, run_cli

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
mlflow_tracking = pytest.importorskip("mlflow.tracking")

# Keys that differ between two runs of the same step (wall-clock), when a resumed run repeats a step.
TIMING = ("timing/", "throughput/")


@pytest.fixture(autouse=True)
def offline_env(tmp_path, monkeypatch):
    """No network and nothing written outside tmp_path; the CLI subprocesses inherit this. WANDB_SILENT is
    left unset: the W&B tracker itself keeps W&B's output off the terminal."""
    home = tmp_path / "tracker_home"
    for var, value in {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false",
                       "WANDB_X_DISABLE_STATS": "true", "WANDB_DIR": home, "WANDB_CONFIG_DIR": home / "config",
                       "WANDB_CACHE_DIR": home / "cache", "WANDB_DATA_DIR": home / "data",
                       "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
                       "DO_NOT_TRACK": "true"}.items():
        monkeypatch.setenv(var, str(value))


def sft(assets, run_dir, mlruns, *extra):
    return run_cli("train", "sft", f"run_dir={run_dir}", f"data.train_path={assets / 'train.jsonl'}",
                   f"data.val_path={assets / 'val.jsonl'}", f"tokenizer.path={assets / 'tokenizer'}",
                   "logging.progress=false", "logging.tensorboard=false", "trainer.global_batch_size=8",
                   "trainer.micro_batch_size=4", "trainer.val_interval=2", "trainer.val_batches=1",
                   "optim.decay_steps=6", "logging.wandb.project=aligner-test", "logging.wandb.mode=offline",
                   f"logging.mlflow.tracking_uri=file:{mlruns}", *extra)


# ---- reading the trackers back ---------------------------------------------------------------------
def wandb_records(path):
    """The records of a W&B transaction log (run-<id>.wandb): a 7-byte header, then LevelDB-log chunks
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    data, pos, pending = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_run(run_dir_of_wandb):
    """id, config, history {step: {key: value}} and summary of one offline run (W&B's own `_` keys left out)."""
    run = {"config": {}, "history": {}, "summary": {}}
    for record in wandb_records(next(run_dir_of_wandb.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"][row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            for u in record.summary.update:
                key = u.key or "/".join(u.nested_key)
                if not key.startswith("_"):
                    run["summary"][key] = json.loads(u.value_json)
    return run


def wandb_runs(run_dir):
    return [read_wandb_run(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]


def mlflow_runs(mlruns, experiment):
    client = mlflow_tracking.MlflowClient(f"file:{mlruns}")
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def mlflow_history(client, run_id, keys) -> dict:
    """{step: {key: value}} of `keys`, failing on a step logged twice."""
    history = {}
    for key in keys:
        for m in client.get_metric_history(run_id, key):
            assert key not in history.setdefault(m.step, {}), f"step {m.step} of {key} logged twice"
            history[m.step][key] = m.value
    return history


def by_step(metrics, *, timing_too_for=None) -> dict:
    """metrics.jsonl as {step: {key: value}}; steps outside `timing_too_for` keep all keys."""
    return {m["step"]: {k: v for k, v in m.items() if k != "step" and
                        (timing_too_for is None or m["step"] in timing_too_for or not k.startswith(TIMING))}
            for m in metrics}


def without_timing(history: dict, steps) -> dict:
    return {s: {k: v for k, v in row.items() if s not in steps or not k.startswith(TIMING)} for s, row in history.items()}


def assert_quiet(result):
    """W&B's own terminal lines (`wandb: ...`) stay off the terminal."""
    noise = [line for line in (result.stdout + result.stderr).splitlines() if line.lower().startswith("wandb")]
    assert not noise, noise


# ---- through the CLI -------------------------------------------------------------------------------
def test_trackers_log_what_metrics_jsonl_logs_and_a_resumed_run_continues_them(tiny_assets, tmp_path):
    run_dir, mlruns = tmp_path / "run", tmp_path / "mlruns"
    # checkpoint at step 3, steps 1-4 logged: the resumed run restores step 3 and repeats step 4
    first = sft(tiny_assets, run_dir, mlruns, "trainer.max_steps=4", "trainer.save_interval=3",
                "trainer.save_last=false")
    assert_cli_ok(first)
    assert_quiet(first)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and "val/loss" in metrics[1]

    [wb] = wandb_runs(run_dir)
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert wb["id"] == ids["wandb"]
    assert wb["history"] == by_step(metrics)
    assert wb["summary"] == {k: v for m in metrics for k, v in m.items() if k != "step"}  # each key's last value
    assert wb["config"]["trainer.max_steps"] == 4 and wb["config"]["logging.wandb.mode"] == "offline"

    client, [ml] = mlflow_runs(mlruns, tmp_path.name)  # default experiment: the run directory's parent
    assert ml.info.run_id == ids["mlflow"] and ml.info.run_name == "run" and ml.info.status == "FINISHED"
    keys = {k for m in metrics for k in m} - {"step"}
    assert mlflow_history(client, ml.info.run_id, keys) == by_step(metrics)
    assert ml.data.params["trainer.max_steps"] == "4" and ml.data.params["model.num_layers"] == "4"

    resumed = sft(tiny_assets, run_dir, mlruns, "trainer.max_steps=6", "trainer.save_interval=3",
                  "trainer.save_last=false")
    assert_cli_ok(resumed)
    assert_quiet(resumed)
    assert "resumed from" in resumed.stderr and "step_000003 at step 3" in resumed.stderr
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run_dir / "trackers.json").read_text()) == ids

    # W&B offline: a second offline run file of the same run id (`wandb sync` uploads the two to that run,
    # in order) with only the new steps; step 4 is kept from the first attempt (same values but timings).
    before, after = wandb_runs(run_dir)
    assert before["id"] == after["id"] == ids["wandb"]
    assert sorted(before["history"]) == [1, 2, 3, 4] and sorted(after["history"]) == [5, 6]
    expected = by_step(metrics, timing_too_for={1, 2, 3, 5, 6})
    assert without_timing({**before["history"], **after["history"]}, {4}) == expected
    assert after["config"]["trainer.max_steps"] == 6

    client, [ml] = mlflow_runs(mlruns, tmp_path.name)  # still one MLflow run, each step once
    assert ml.info.run_id == ids["mlflow"] and ml.info.status == "FINISHED"
    assert without_timing(mlflow_history(client, ml.info.run_id, keys), {4}) == expected
    assert ml.data.params["trainer.max_steps"] == "4"  # MLflow params cannot change: the first value stays


@pytest.mark.dist
def test_only_rank_0_logs_to_the_trackers(tiny_assets, tmp_path):
    run_dir, mlruns = tmp_path / "run", tmp_path / "mlruns"
    result = sft(tiny_assets, run_dir, mlruns, "trainer.max_steps=2", "launcher.nproc_per_node=2",
                 "logging.mlflow.experiment=dp2", "logging.mlflow.run_name=two-ranks", "logging.wandb.name=two-ranks")
    assert_cli_ok(result)
    assert_quiet(result)
    metrics = read_metrics(run_dir)
    [wb] = wandb_runs(run_dir)
    assert wb["history"] == by_step(metrics)
    client, [ml] = mlflow_runs(mlruns, "dp2")
    assert ml.info.run_name == "two-ranks"
    assert mlflow_history(client, ml.info.run_id, {k for m in metrics for k in m} - {"step"}) == by_step(metrics)
    assert "W&B run" not in (run_dir / "logs" / "rank_1.log").read_text()


def test_a_bad_wandb_mode_fails_at_config_time(tiny_assets, tmp_path):
    result = sft(tiny_assets, tmp_path / "run", tmp_path / "mlruns", "logging.wandb.mode=onlin")
    assert result.returncode == 2
    assert "logging.wandb.mode" in result.stderr and "online, offline" in result.stderr
    assert not (tmp_path / "run").exists()


# ---- in this process -------------------------------------------------------------------------------
def test_a_missing_tracker_package_names_the_key_and_the_extra(tmp_path, monkeypatch):
    cfg = OmegaConf.structured(SFTRunConfig)
    cfg.logging.wandb.project = "p"
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"logging.wandb.project=p needs .*pip install 'aligner\[wandb\]'"):
        validate_trackers(cfg.logging)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an absent package imports as
    with pytest.raises(ImportError, match=r"logging.wandb.project is set.*pip install 'aligner\[wandb\]'"):
        open_trackers(tmp_path, cfg, 0)


def test_trackers_are_off_by_default_and_a_fresh_start_opens_a_new_run(tmp_path):
    cfg = OmegaConf.structured(SFTRunConfig)
    assert open_trackers(tmp_path, cfg, 0) == [] and not (tmp_path / "trackers.json").exists()
    cfg.logging.mlflow.tracking_uri = f"file:{tmp_path / 'mlruns'}"

    def open_one(resume_step, logged_through=-1):
        [tracker] = open_trackers(tmp_path, cfg, resume_step, logged_through)
        tracker.close()
        return tracker

    first = open_one(0)
    continued = open_one(3, logged_through=5)  # restored from a checkpoint: the same run, steps <= 5 there already
    assert continued.id == first.id and continued.skip_through == 5
    restarted = open_one(0)  # no checkpoint: metrics.jsonl starts over, and so do the trackers
    assert restarted.id != first.id and restarted.skip_through == -1
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"mlflow": restarted.id}
