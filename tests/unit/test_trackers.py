"""run.loggers (earl_megatron/trackers): the keys each tracker gets, the steps evaluations go
to, the refusals (an unknown name, a package that is not installed, run.tensorboard), a tracker
that fails at runtime dropped with one message while the others go on, TensorBoard's resumed
segment. The full run with every tracker, read back by each one's reader, is
tests/distributed/test_tracker_runs.py."""

import io

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from earl_megatron.config.compose import compose
from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.testing.tracker_readers import read
from earl_megatron.trackers import (
    Trackers,
    check_installed,
    eval_metrics,
    eval_step,
    flatten,
)
from earl_megatron.trainer.live import LiveView


def record(it):
    return {"iteration": it, "layouts": {"rollout": "DP4", "train": "TP2"},
            "reward": -0.5 + 0.25 * it, "loss": 0.0123, "max_context": 300 + it,
            "skipped": "no group with signal", "nan": float("nan"), "flag": True,
            "seconds": {"plan+switch": 0.2, "train": 4.5, "total": 17.4},
            "predicted_memory_gb": {"train": 3.25}}


def test_flatten_keeps_numbers_and_joins_nested_keys():
    assert flatten(record(1)) == {
        "iteration": 1.0, "reward": -0.25, "loss": 0.0123, "max_context": 301.0,
        "seconds/plan+switch": 0.2, "seconds/train": 4.5, "seconds/total": 17.4,
        "predicted_memory_gb/train": 3.25}
    assert eval_metrics({"random/greedy": {"win_rate": 0.5, "mean_reward": 0.1}}) == {
        "eval/random/greedy/win_rate": 0.5, "eval/random/greedy/mean_reward": 0.1}


def test_an_evaluation_is_logged_at_the_iterations_done_when_it_ran():
    hist = [record(0), record(1), record(2)]
    assert [eval_step(w, hist) for w in ("start", "iter2", "end")] == [0, 2, 3]
    assert eval_step("start", [], first=5) == 5 and eval_step("end", [], first=5) == 5


def _cfg(**run):
    return TrainConfig.from_dict({"run": run})


def test_loggers_is_a_list_on_the_command_line():
    d = OmegaConf.to_container(compose(["run.loggers=[wandb,mlflow]"]), resolve=True)
    assert TrainConfig.from_dict(d).run.loggers == ("wandb", "mlflow")
    assert TrainConfig().run.loggers == ()


@pytest.mark.parametrize("run, match", [
    ({"loggers": ["neptune"]}, r"run.loggers: unknown tracker 'neptune'; choose from "
                               r"\['tensorboard', 'wandb', 'mlflow', 'trackio', 'swanlab'\]"),
    ({"loggers": ["wandb", "wandb"]}, "run.loggers lists 'wandb' twice"),
    ({"tensorboard": True}, r"run.tensorboard was replaced: use run.loggers=\[tensorboard\]"),
])
def test_bad_loggers_are_refused_by_name(run, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**run)


def test_a_tracker_not_installed_is_refused_naming_its_extra(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    # as where the package is absent: find_spec answers None for it
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "swanlab" else real(name, *a))
    check_installed(["tensorboard", "wandb"])
    with pytest.raises(ConfigError) as e:
        check_installed(["tensorboard", "swanlab"])
    assert str(e.value) == ("run.loggers=swanlab: the swanlab package is not installed; pip "
                            "install earl_megatron[swanlab] (or drop swanlab from run.loggers)")


def test_the_launcher_refuses_it_before_any_rank_starts(monkeypatch, capsys):
    import importlib.util

    from earl_megatron.cli import check_config
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        check_config(["run.loggers=[tensorboard,mlflow]"], None, None)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install earl_megatron[mlflow]" in err[0]


def test_a_tracker_that_fails_is_dropped_with_one_message_and_the_others_go_on(tmp_path):
    # TensorBoard cannot make its folder where a file stands: a real failure of its writer
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file, not a folder")
    said: list[str] = []
    trackers = Trackers(["tensorboard", "mlflow"], out, say=said.append)
    with trackers.started({"run": {"seed": 0, "loggers": ("tensorboard", "mlflow")}}):
        for it in range(2):
            trackers.log(record(it))
        trackers.log_eval({"random/greedy": {"win_rate": 0.5}}, 2)
    failed = [s for s in said if "failed" in s]
    assert len(failed) == 1 and failed[0].startswith("tensorboard: start failed (")
    assert failed[0].endswith("tracker disabled, metrics.jsonl has every value")
    series, config = read("mlflow", out)
    assert series["reward"] == {0: -0.5, 1: -0.25}
    assert series["seconds/plan_switch"] == {0: 0.2, 1: 0.2}
    assert series["eval/random/greedy/win_rate"] == {2: 0.5}
    assert config == {"run.seed": "0", "run.loggers": "['tensorboard', 'mlflow']"}


def test_disabled_trackers_do_nothing(tmp_path):
    trackers = Trackers(["tensorboard"], tmp_path, enabled=False)
    with trackers.started({}):
        trackers.log(record(0))
    assert not list(tmp_path.iterdir())


def test_tensorboard_resumed_segment_purges_later_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # iteration 2 was recorded, then the run died before its checkpoint: the next segment
    # starts at 2 again, and no step appears twice
    for start, its in ((0, range(3)), (2, range(2, 4))):
        trackers = Trackers(["tensorboard"], tmp_path, start, say=lambda s: None)
        with trackers.started({"a": 1}):
            for it in its:
                trackers.log(record(it))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward")] == [0, 1, 2, 3]
    assert read("tensorboard", tmp_path)[1] == {"a": 1}


def test_the_live_view_says_where_each_tracker_writes(tmp_path):
    buf = io.StringIO()
    with LiveView(total=2, console=Console(file=buf)) as view:
        with Trackers(["tensorboard"], tmp_path, say=view.message).started({}) as trackers:
            trackers.log(record(0))
    assert buf.getvalue().splitlines() == [
        f"tensorboard: event files in {tmp_path}/tensorboard (tensorboard --logdir "
        f"{tmp_path}/tensorboard)"]
