"""Experiment trackers: Weights & Biases (`logging.wandb.*`) and MLflow (`logging.mlflow.*`).

Each is off until its key is set (`logging.wandb.project`, `logging.mlflow.tracking_uri`), imports its
package only then (optional extras: `pip install 'aligner[wandb]'`, `'aligner[mlflow]'`), gets the run's
config flattened to dotted keys as its config/params, and gets exactly what metrics.jsonl gets: the same
steps and keys, from the logging rank only (MetricsLog owns the trackers).

Resume: the id of each tracker run is kept in `<run_dir>/trackers.json`. A run restored from a
checkpoint continues those tracker runs (W&B: the same run id with resume="allow"; MLflow: the same
run id); a run that starts at step 0 starts new ones, as metrics.jsonl starts over. An id generated
once and kept in the run directory, rather than one hashed from its path, cannot collide with another
user's or machine's run in the same project that happens to use the same (e.g. the default) run_dir.
Steps a continued tracker run already holds (logged after the last checkpoint, before a crash) are
not sent again. W&B's terminal output is silenced; its own logs stay under `<dir>/wandb/`.
"""
from __future__ import annotations

import importlib
import json
import logging
import time
import uuid
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

STATE_FILE = "trackers.json"


def _require(module: str, key: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{key} is set, which needs the `{module}` package: "
                          f"pip install 'aligner[{extra}]' (or unset {key})") from e


def flatten(tree, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; an OmegaConf config is resolved first (enums as their names)."""
    if not isinstance(tree, dict):
        tree = OmegaConf.to_container(tree, resolve=True, enum_to_str=True)
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class Tracker:
    skip_through = -1  # steps the continued tracker run already holds

    def log(self, step: int, metrics: dict) -> None:
        if step > self.skip_through:
            self._log(step, metrics)

    def _log(self, step: int, metrics: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class WandbTracker(Tracker):
    key = "wandb"

    def __init__(self, c, run_dir: Path, config: dict, run_id: str | None):
        wandb = _require("wandb", "logging.wandb.project", "wandb")
        self.run = wandb.init(
            project=c.project, entity=c.entity, name=c.name or run_dir.name, id=run_id or uuid.uuid4().hex[:16],
            resume="allow", mode=str(c.mode) if c.mode else None, dir=c.dir or str(run_dir), config=config,
            settings=wandb.Settings(silent=True, console="off"))
        self.id = self.run.id
        where = f"{Path(self.run.dir).parent} (upload it with `wandb sync`)" if self.run.offline else self.run.url
        log.info("W&B run %s: %s", self.id, where)

    def _log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    key = "mlflow"
    _PARAMS_PER_CALL = 100  # MLflow's log_batch limit

    def __init__(self, c, run_dir: Path, config: dict, run_id: str | None):
        _require("mlflow", "logging.mlflow.tracking_uri", "mlflow")
        from mlflow.entities import Metric, Param  # optional (aligner[mlflow]), required just above
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.client = MlflowClient(c.tracking_uri)
        run = self._find(run_id)
        params = {k: str(v) for k, v in config.items()}
        if run is None:
            experiment = c.experiment or run_dir.parent.name
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=c.run_name or run_dir.name)
        else:  # MLflow refuses to change a logged param: the first value stays, config.yaml has the new one
            changed = sorted(k for k, v in params.items() if run.data.params.get(k, v) != v)
            if changed:
                log.warning("MLflow run %s keeps its first values of %s", run.info.run_id, ", ".join(changed))
            params = {k: v for k, v in params.items() if k not in run.data.params}
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.id = run.info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), self._PARAMS_PER_CALL):
            self.client.log_batch(self.id, params=items[i:i + self._PARAMS_PER_CALL])
        log.info("MLflow run %s at %s", self.id, c.tracking_uri)

    def _find(self, run_id: str | None):
        if run_id is None:
            return None
        try:
            return self.client.get_run(run_id)
        except Exception as e:  # deleted, or another tracking server: start a new run
            log.warning("MLflow run %s cannot be continued (%s); starting a new one", run_id, e)
            return None

    def _log(self, step: int, metrics: dict) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[self.Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.id)


def open_trackers(run_dir, cfg, resume_step: int, logged_through: int = -1) -> list[Tracker]:
    """The trackers `cfg.logging` turns on. `resume_step` > 0: continue the tracker runs named in
    `<run_dir>/trackers.json`, whose steps up to `logged_through` are not sent again."""
    run_dir = Path(run_dir).resolve()
    state_path = run_dir / STATE_FILE
    state = json.loads(state_path.read_text()) if resume_step > 0 and state_path.exists() else {}
    wanted = [(WandbTracker, cfg.logging.wandb)] if cfg.logging.wandb.project else []
    if cfg.logging.mlflow.tracking_uri:
        wanted.append((MlflowTracker, cfg.logging.mlflow))
    config = flatten(cfg) if wanted else {}
    trackers = []
    for kind, tracker_cfg in wanted:
        try:
            tracker = kind(tracker_cfg, run_dir, config, state.get(kind.key))
        except ImportError:
            raise
        except Exception as e:
            raise RuntimeError(f"logging.{kind.key}: the tracker run could not start: {e}") from e
        if tracker.id == state.get(kind.key):
            tracker.skip_through = logged_through
        state[kind.key] = tracker.id
        trackers.append(tracker)
    if trackers:
        state_path.write_text(json.dumps(state, indent=1) + "\n")
    return trackers
