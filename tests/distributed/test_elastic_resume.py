"""Elastic resume: a checkpoint written on 4 ranks resumes on 2, and that run's checkpoint on 4
again. Layouts are planned anew for the new world (layout=auto), the selector state is reset
with a message, Megatron's checkpoint loads under the new layouts (dist_checkpointing reshards),
and the metrics continue: every iteration exactly once, the earlier segments' records kept as
they were, eval.json merged across the three segments. With layout=static the layouts of the
new world come from the config."""

import json

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed


def _cfg(out, iterations, algorithm=None, **layout):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": layout or {"mode": "auto"},
        "env": {"name": "connect_four",
                "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": algorithm or {"micro_batch_size": 2},
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


PPO = {"name": "ppo", "micro_batch_size": 2, "critic": {"lr": 1e-2}}


def _train_reloading(cfg, reloaded):
    """``_train``, and right after the critic loads from the checkpoint it is saved again, as
    this world holds it, into ``reloaded`` (a collective save in the new layout)."""
    from pathlib import Path

    from earl_megatron.runtime.checkpoint import save_model_state
    from earl_megatron.trainer import critic as critic_mod

    load = critic_mod.load_critic

    def loading(critic, checkpoint):
        load(critic, checkpoint)
        save_model_state(critic, Path(reloaded))

    critic_mod.load_critic = loading
    return _train(cfg)


def _tensors(dcp_dir, tmp):
    """Every tensor of a dist_checkpointing directory, read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dcp_dir), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items()
            if isinstance(v, torch.Tensor)}


def test_static_layout_of_the_new_world(tmp_path):
    """2 ranks -> 4 under static layouts, PPO: the critic (issue #45) lives in layout.train,
    TP2 and then TP2xDP2, and what the 4 ranks load from the 2 ranks' critic/ is that checkpoint
    (saved again right after the load and read back: every tensor, weights and Adam state,
    bit-exact)."""
    import torch

    out = tmp_path / "static"
    first = run_distributed(_train, 2, _cfg(out, 1, mode="static", rollout="dp2",
                                            logprob="dp2", train="tp2", algorithm=PPO),
                            timeout=500)[0]
    hist = run_distributed(_train_reloading, 4,
                           _cfg(out, 2, mode="static", rollout="dp4", logprob="dp4",
                                train="tp2", algorithm=PPO), str(tmp_path / "reloaded"),
                           timeout=500)[0]
    assert [h["iteration"] for h in hist] == [0, 1] and hist[0] == first[0]
    assert hist[1]["layouts"] == {"rollout": "DP4", "train": "TP2xDP2"}
    assert [h["critic_layout"] for h in hist] == ["TP2", "TP2xDP2"], hist
    assert all(h["value_loss"] > 0 for h in hist), hist
    saved = _tensors(out / "checkpoints" / "iter_000000" / "critic", tmp_path / "a.pt")
    again = _tensors(tmp_path / "reloaded", tmp_path / "b.pt")
    assert saved.keys() == again.keys() and any("exp_avg" in k for k in saved), sorted(saved)
    assert any(k.startswith("value_head.") for k in saved), sorted(saved)
    assert [k for k in saved if not torch.equal(saved[k], again[k])] == []
