"""Every tracker of run.loggers through the trainer, offline, in one launch (2 ranks, 2
iterations, all five loggers at once): each tracker's store, read back with that tracker's own
reader (earl_megatron/testing/tracker_readers.py), holds metrics.jsonl's values at every
iteration (the iteration as the step), the evaluations as their own series at the iterations
done when they ran, and the run's configuration (resolved.json). Rank 1 writes nothing."""

import json
import math

import pytest

from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.testing.multiproc import run_distributed
from earl_megatron.testing.tracker_readers import read
from earl_megatron.trackers import LOGGERS, flatten
from earl_megatron.trackers.to_mlflow import metric_key, params

KEYS = ("loss", "reward", "grad_norm", "seconds/train", "seconds/total", "mean_context")


def _cfg(out):
    return tiny_connect_four(out, algorithm={"name": "reinforce_pp"},
                             run={"eval_every": 1, "loggers": list(LOGGERS)})


def _run(out):
    from earl_megatron.train import run
    run(_cfg(out))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("trackers") / "run"
    run_distributed(_run, 2, str(out), timeout=600)
    return out


@pytest.mark.parametrize("name", list(LOGGERS))
def test_tracker_holds_the_metrics_the_evaluations_and_the_config(run_dir, name):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1]
    series, config = read(name, run_dir)
    # float32 in TensorBoard's event files; every other tracker keeps the float64 exactly
    rel = 1e-6 if name == "tensorboard" else 0.0
    # MLflow's names allow fewer characters: seconds/plan+switch is seconds/plan_switch there
    key_of = metric_key if name == "mlflow" else str
    for rec in lines:
        flat = {key_of(k): v for k, v in flatten(rec).items()}
        for key in KEYS:
            got = series[key][rec["iteration"]]
            assert math.isclose(got, flat[key], rel_tol=rel, abs_tol=0.0), (key, rec, got)
        # every number of the line is there, nothing else is at its step (but SwanLab's own
        # system metrics, kept as SwanLab's users expect them)
        assert {k for k, v in series.items() if rec["iteration"] in v
                and not k.startswith(("eval/", "__swanlab__."))} == set(flat) - {"iteration"}
    evals = json.loads((run_dir / "eval.json").read_text())
    assert set(evals) == {"start", "iter1", "end"}
    for when, step in (("start", 0), ("iter1", 1), ("end", 2)):
        for key, value in flatten(evals[when], "eval/").items():
            key = key_of(key)
            assert math.isclose(series[key][step], value, rel_tol=rel), (key, when)
    resolved = json.loads((run_dir / "resolved.json").read_text())
    if name == "mlflow":   # parameters: the nested keys joined with '.', values as text
        assert config == params(resolved) and config["run.seed"] == "0"
    else:
        assert config == resolved


def test_every_tracker_writes_under_the_run_directory(run_dir):
    names = {p.name for p in run_dir.iterdir()}
    assert {"tensorboard", "wandb", "mlflow.db", "trackio", "swanlog", "trackers"} <= names
