"""Elastic resume: a checkpoint written on 4 ranks resumes on 2, and that run's checkpoint on 4
again. Layouts are planned anew for the new world (layout=auto), the selector state is reset
with a message, Megatron's checkpoint loads under the new layouts (dist_checkpointing reshards),
and the metrics continue: every iteration exactly once, the earlier segments' records kept as
they were, eval.json merged across the three segments. With layout=static the layouts of the
new world come from the config."""

import json

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed


def _cfg(out, iterations, **layout):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": layout or {"mode": "auto"},
        "env": {"name": "connect_four",
                "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"micro_batch_size": 2},
        "run": {"iterations": iterations, "output_dir": str(out), "checkpoint_every": 1,
                "eval_episodes": 2, "live_view": False},
    })


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _product(layout: str) -> int:
    n = 1
    for axis in layout.split("x"):
        digits = "".join(c for c in axis if c.isdigit())
        n *= int(digits or 1)
    return n


def test_four_ranks_to_two_and_back(tmp_path, capfd):
    out = tmp_path / "run"
    first = run_distributed(_train, 4, _cfg(out, 2), timeout=500)[0]
    second = run_distributed(_train, 2, _cfg(out, 4), timeout=500)[0]
    text = capfd.readouterr().out
    assert "checkpoint of 4 ranks resumed on 2" in text and "selector state reset" in text
    third = run_distributed(_train, 4, _cfg(out, 6), timeout=500)[0]
    text = capfd.readouterr().out
    assert "checkpoint of 2 ranks resumed on 4" in text

    assert [h["iteration"] for h in third] == list(range(6))
    assert third[:2] == first and third[:4] == second  # earlier records kept as they were
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == third
    for h, world in zip(third, [4, 4, 2, 2, 4, 4]):
        assert all(_product(lay) == world for lay in h["layouts"].values()), (world, h["layouts"])
    assert all(h["reward"] == h["reward"] for h in third)  # numbers, not NaN, after each resume
    evals = json.loads((out / "eval.json").read_text())
    assert set(evals) == {"start", "iter2", "iter4", "end"}, evals


def test_static_layout_of_the_new_world(tmp_path):
    out = tmp_path / "static"
    run_distributed(_train, 2, _cfg(out, 1, mode="static", rollout="dp2", logprob="dp2",
                                    train="tp2"), timeout=500)
    hist = run_distributed(_train, 4, _cfg(out, 2, mode="static", rollout="dp4", logprob="dp4",
                                           train="tp2"), timeout=500)[0]
    assert [h["iteration"] for h in hist] == [0, 1]
    assert hist[1]["layouts"] == {"rollout": "DP4", "train": "TP2xDP2"}
