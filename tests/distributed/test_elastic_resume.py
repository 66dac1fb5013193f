"""Elastic resume: a checkpoint written on 4 ranks resumes on 2, and that run's checkpoint on 4
again. Layouts are planned anew for the new world (layout=auto), the selector state is reset
with a message, Megatron's checkpoint loads under the new layouts (dist_checkpointing reshards),
and the metrics continue: every iteration exactly once, the earlier segments' records kept as
they were, eval.json merged across the three segments. With layout=static the layouts of the
new world come from the config."""

import json

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed


def _cfg(out, iterations, algorithm=None, model=None, **layout):
    return TrainConfig.from_dict({
        "model": model or {"vocab_size": 32},
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
    """``_train``, and right after the policy and the critic load from the checkpoint each is
    saved again, as this world holds it, into ``reloaded``/policy and /critic (collective
    saves in the new layouts)."""
    from pathlib import Path

    from earl_megatron.runtime.checkpoint import save_model_state
    from earl_megatron.trainer import critic as critic_mod
    from earl_megatron.trainer import resume as resume_mod

    def again(load, what):
        def loading(model, checkpoint):
            out = load(model, checkpoint)
            save_model_state(model, Path(reloaded) / what)
            return out
        return loading

    critic_mod.load_critic = again(critic_mod.load_critic, "critic")
    resume_mod.load_checkpoint = again(resume_mod.load_checkpoint, "policy")
    return _train(cfg)


def _tensors(dcp_dir, tmp):
    """Every tensor of a dist_checkpointing directory, read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dcp_dir), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items()
            if isinstance(v, torch.Tensor)}


def test_static_layout_of_the_new_world(tmp_path):
    """2 ranks -> 4 under static layouts, a LoRA policy (issue #46) trained by PPO: the critic
    (issue #45) lives in layout.train, TP2 and then TP2xDP2; what the 4 ranks load from the 2
    ranks' checkpoint, the policy (its base, its adapters and their Adam state) and critic/, is
    that checkpoint (each saved again right after its load and read back: every tensor,
    bit-exact)."""
    import torch

    out = tmp_path / "static"
    lora = {"vocab_size": 32, "lora": {"rank": 4, "alpha": 8}}
    first = run_distributed(_train, 2, _cfg(out, 1, mode="static", rollout="dp2",
                                            logprob="dp2", train="tp2", algorithm=PPO,
                                            model=lora), timeout=500)[0]
    hist = run_distributed(_train_reloading, 4,
                           _cfg(out, 2, mode="static", rollout="dp4", logprob="dp4",
                                train="tp2", algorithm=PPO, model=lora),
                           str(tmp_path / "reloaded"), timeout=500)[0]
    assert [h["iteration"] for h in hist] == [0, 1] and hist[0] == first[0]
    assert hist[1]["layouts"] == {"rollout": "DP4", "train": "TP2xDP2"}
    assert [h["critic_layout"] for h in hist] == ["TP2", "TP2xDP2"], hist
    assert all(h["value_loss"] > 0 for h in hist), hist
    ckpt = out / "checkpoints" / "iter_000000"
    for what, src, marks in (("critic", ckpt / "critic", ("value_head.", "exp_avg")),
                             ("policy", ckpt, ("lora_b", "exp_avg.decoder.layers.mlp.linear_"
                                                         "fc1.lora_a"))):
        saved = _tensors(src, tmp_path / f"{what}_a.pt")
        again = _tensors(tmp_path / "reloaded" / what, tmp_path / f"{what}_b.pt")
        assert saved.keys() == again.keys(), (what, sorted(saved.keys() ^ again.keys()))
        assert all(any(m in k for k in saved) for m in marks), (what, sorted(saved))
        assert [k for k in saved if not torch.equal(saved[k], again[k])] == [], what
