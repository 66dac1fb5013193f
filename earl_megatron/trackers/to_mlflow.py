"""MLflow: a run in the experiment ``MLFLOW_EXPERIMENT_NAME`` (default "earl_megatron") of the
tracking server ``MLFLOW_TRACKING_URI``; without it, the file store ``<output_dir>/mlruns``
(``mlflow ui --backend-store-uri file:<output_dir>/mlruns``).

MLflow allows letters, digits and ``_-. :/`` in a metric's name: any other character becomes
'_' (``seconds/plan+switch`` is ``seconds/plan_switch`` there). The configuration is logged as
the run's parameters (nested keys joined with '.', values as
text). The run's id is kept in <output_dir>/trackers/mlflow_run_id: a resumed segment logs
into the same run.
"""

from __future__ import annotations

import os
import re
import time

from earl_megatron.trackers import PROJECT, Tracker, configured_by_env

MAX_PARAM = 6000
"""MLflow's longest parameter value (characters); a longer value is cut."""


def metric_key(key: str) -> str:
    """``key`` as MLflow takes it (module docstring)."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def params(config: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:MAX_PARAM]
    return out


class MlflowTracker(Tracker):
    name = "mlflow"

    def start(self, config: dict) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = None if configured_by_env("mlflow") else \
            "sqlite:///" + str((self.out_dir / "mlflow.db").resolve())
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        id_file = self.out_dir / "trackers" / "mlflow_run_id"
        run_id = id_file.read_text().strip() if self.start_iteration and id_file.is_file() \
            else None
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id)
            items = [Param(k, v) for k, v in params(config).items()]
            for i in range(0, len(items), 100):    # MLflow takes 100 parameters a batch
                self.client.log_batch(run_id, params=items[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return f"run {run_id} in experiment {name!r} at {self.client.tracking_uri}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(metric_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):       # and 1000 metrics
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


ADAPTER = MlflowTracker
