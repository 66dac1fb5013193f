"""The trainer end to end on 2 ranks: a short run records metrics, checkpoints, and a run resumed
from a checkpoint reproduces the uninterrupted run's metrics; bad config stops before training."""

import json

import pytest

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.testing.multiproc import run_distributed


def _cfg(out, iterations, **layout):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": layout or {"mode": "static", "rollout": "dp2", "logprob": "dp2",
                             "train": "tp2"},
        "env": {"name": "connect_four",
                "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"micro_batch_size": 2},
        "run": {"iterations": iterations, "output_dir": out, "checkpoint_every": 1,
                "eval_episodes": 2, "live_view": False},
    })


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _strip(history):
    return [{k: v for k, v in h.items() if k not in ("seconds",)} for h in history]


def test_short_run_and_resume(tmp_path):
    full = run_distributed(_train, 2, _cfg(str(tmp_path / "full"), 3), timeout=400)[0]
    assert [h["iteration"] for h in full] == [0, 1, 2]
    assert all(h["layouts"] == {"rollout": "DP2", "train": "TP2"} for h in full)
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["iteration"] == 0
    assert (tmp_path / "full" / "report.png").stat().st_size > 10_000
    evals = json.loads((tmp_path / "full" / "eval.json").read_text())
    assert set(evals) == {"start", "end"} and "random/greedy" in evals["end"]

    # "killed" after iteration 1: a run of 2 iterations leaves checkpoint iter_000001; the
    # resumed run must replay iteration 2 exactly as the uninterrupted run did
    part = str(tmp_path / "part")
    run_distributed(_train, 2, _cfg(part, 2), timeout=400)
    resumed = run_distributed(_train, 2, _cfg(part, 3), timeout=400)[0]
    assert [h["iteration"] for h in resumed] == [0, 1, 2]
    assert _strip(resumed) == _strip(full)


def test_auto_layouts_change_under_a_memory_budget(tmp_path):
    cfg = _cfg(str(tmp_path / "auto"), 2, mode="auto", memory_budget_gb=0.05)
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    assert len(hist) == 2 and "predicted_memory_gb" in hist[0]


def test_evaluation_after_a_cp_train_layout(tmp_path):
    # the engine decodes with cp=1: the end-of-run evaluation must still happen after CP2
    cfg = _cfg(str(tmp_path / "cp"), 1, mode="static", rollout="dp2", logprob="dp2", train="cp2")
    hist = run_distributed(_train, 2, cfg, timeout=400)[0]
    assert hist[0]["layouts"]["train"] == "CP2"
    evals = json.loads((tmp_path / "cp" / "eval.json").read_text())
    assert "random/sampled" in evals["end"]


def _bad(cfg):
    from earl_megatron.train import run
    try:
        run(cfg)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_bad_config_stops_before_training(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        TrainConfig.from_dict({"algorithm": {"lrr": 1.0}})
    with pytest.raises(ConfigError, match="layout.mode=static needs"):
        TrainConfig.from_dict({"layout": {"mode": "static", "train": "tp2"}})
    msgs = run_distributed(_bad, 2, TrainConfig.from_dict({
        "env": {"name": "chess"}, "run": {"output_dir": str(tmp_path / "x")}}), timeout=120)
    assert "not a registered environment" in msgs[0]
    msgs = run_distributed(_bad, 2, TrainConfig.from_dict({
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp4"},
        "run": {"output_dir": str(tmp_path / "y")}}), timeout=120)
    assert "layout.train=tp4" in msgs[0] and "world size 2" in msgs[0]
    msgs = run_distributed(_bad, 2, TrainConfig.from_dict({
        "cluster": {"nodes": 2}, "run": {"output_dir": str(tmp_path / "z")}}), timeout=120)
    assert "cluster.nodes=2" in msgs[0]
