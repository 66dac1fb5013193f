"""PPO's critic under split placement (issue #45 with #43's placements): one 3-rank launch.

The train pool (ranks 0-1) scores in DP2 and trains in TP2; the critic lives in TP2, the
pool's TRAIN layout, beside the policy and the KL reference; the rollout pool (rank 2) plays on
its one rank (TP1), one version ahead (k = 1). Connect Four, GAE (gamma 0.99, lam 0.9), 3
iterations:

- every record holds the value metrics, finite, with the critic in TP2 and the split's
  numbers; the rollout pool sent every episode and the train pool trained each exactly once
  (tests/distributed/split_audit.py), and after every handoff both pools' weights hash equal;
- the checkpoint holds the critic (critic/, written by the train pool while the rollout rank
  joins with nothing); a run of 2 iterations records exactly the full run's first 2, and
  resumed to 3 its train pool's critic is, weights and Adam state, the one saved at iteration
  1 (a split's resume plays the saved stage again under the newer weights, lag 0, so its
  iteration 2 is not the full run's: trainer/split.py);
- rollout.placement=auto with the planner's decisions forced to split (1 rollout rank),
  colocated (DP3), split again: each move checkpoints and every rank builds its side from
  that checkpoint, so the critic moves DP2 -> DP3 -> DP2 through critic/ with its Adam state;
  every batch sent is the batch trained and every iteration's value metrics are finite.
"""

import math

import pytest

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed
from split_audit import check_exactly_once, check_handoffs, read_audit, sent_and_trained

PPO = {"name": "ppo", "group_size": 2, "micro_batch_size": 2, "gamma": 0.99, "lam": 0.9,
       "kl_mode": "loss", "kl_coef": 0.1, "max_staleness": 1, "off_policy": "decoupled",
       "old_logprobs": "recompute", "critic": {"lr": 1e-2, "clip": 0.2}}
VALUE_KEYS = ("value_loss", "explained_variance", "value_clip_frac", "value_mean",
              "return_mean", "value_grad_norm")


def _cfg(out, iterations, placement="split", init=None):
    fixed = placement == "split"
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp1", "logprob": "dp2", "train": "tp2"}
        if fixed else {"mode": "auto"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": []},
        "rollout": {"episodes_per_iteration": 6, "max_turns": 3, "placement": placement,
                    **({"pool_ranks": 1} if fixed else {})},
        "algorithm": {**PPO, "critic": {**PPO["critic"], "init": init}},
        "run": {"iterations": iterations, "output_dir": str(out), "eval_episodes": 2,
                "live_view": False, "checkpoint_every": 1 if fixed else 0},
    })


def _digest(critic) -> str:
    """sha256 of this rank's critic: its parameters and its optimizer's Adam state."""
    import hashlib

    h = hashlib.sha256()
    for p in critic.model.parameters():
        h.update(p.detach().float().numpy().tobytes())
    opt = critic.optimizer
    for inner in [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]:
        for group in inner.param_groups:
            for p in group["params"]:
                for k, v in sorted(inner.state.get(p, {}).items()):
                    if hasattr(v, "numpy"):
                        h.update(k.encode() + v.detach().float().numpy().tobytes())
    return h.hexdigest()


def _runs(root):
    """The three runs on every rank; the critic's digest at every save and after the load."""
    import os
    from pathlib import Path

    from earl_megatron.train import run
    from earl_megatron.trainer import critic as critic_mod
    from split_audit import train_scheduled

    seen, save, load = [], critic_mod.save_critic, critic_mod.load_critic

    def saving(critic, directory):
        save(critic, directory)
        seen.append(("saved", directory.name, critic and _digest(critic)))

    def loading(critic, checkpoint):
        load(critic, checkpoint)
        seen.append(("loaded", Path(checkpoint).name, critic and _digest(critic)))

    critic_mod.save_critic, critic_mod.load_critic = saving, loading
    root = Path(root)
    os.environ["EARL_SPLIT_AUDIT"] = str(root / "audit")
    # a fresh critic copies its shards of the policy in the same layout (the train pool's
    # ranks); a resumed one is built to be loaded, with nothing read
    from earl_megatron.testing.calls import callers

    with callers(critic_mod, "copied_from") as fresh:
        full = run(_cfg(root / "full", 3))
    os.environ["EARL_SPLIT_AUDIT"] = str(root / "audit_resumed")
    run(_cfg(root / "resumed", 2))
    with callers(critic_mod, "copied_from") as again:
        resumed = run(_cfg(root / "resumed", 3))
    seen.append(("critic copies: fresh, resumed", len(fresh), len(again)))
    moved = train_scheduled(_cfg(root / "auto", 3, "auto"), str(root / "audit_auto"), [1, 0, 1])
    # the full run's trained critic as critic.init: the train pool reads it (trunk and head,
    # dist_checkpointing), the rollout rank joins that read
    os.environ["EARL_SPLIT_AUDIT"] = str(root / "audit_inited")
    inited = run(_cfg(root / "inited", 1, init=str(root / "full" / "checkpoints" /
                                                   "iter_000002")))
    return full, resumed, moved, seen, inited


def _numbers(hist):
    """A record without what a clock decides: the seconds and the split's timings."""
    keep = ("rollout_ranks",)
    return [{k: ({x: y for x, y in v.items() if x in keep} if k == "split" else v)
             for k, v in h.items() if k not in ("seconds", "rollout_decode_s")} for h in hist]


@pytest.mark.timeout(900)
def test_ppo_critic_trains_on_the_split_train_pool_resumes_and_moves(tmp_path):
    results = run_distributed(_runs, 3, str(tmp_path), timeout=800)
    full, resumed, moved, _, inited = results[0]
    assert [h["iteration"] for h in full] == [0, 1, 2]
    for h in full:
        assert all(math.isfinite(h[k]) for k in VALUE_KEYS) and h["value_loss"] > 0, h
        assert 0.0 <= h["value_clip_frac"] <= 1.0 and h["critic_layout"] == "TP2", h
        assert h["layouts"] == {"rollout": "TP1", "logprob": "DP2", "train": "TP2"}, h
        assert h["split"]["rollout_ranks"] == 1 and h["staleness_max"] <= 1, h
        assert {"values", "critic_train"} <= set(h["seconds"]), h["seconds"]
        assert math.isfinite(h["loss"]) and "kl" in h, h
    # the trained critic scores the same first batch otherwise than a new one
    assert [h["iteration"] for h in inited] == [0] and inited[0]["reward"] == full[0]["reward"]
    assert inited[0]["value_mean"] != full[0]["value_mean"], (inited, full[0])
    rows = read_audit(tmp_path / "audit")
    check_exactly_once(rows, 3, per_batch=6)
    check_handoffs(rows)
    ckpt = tmp_path / "full" / "checkpoints" / "iter_000002"
    assert (ckpt / "critic").is_dir() and any((ckpt / "critic").iterdir()), ckpt
    # the run of 2 iterations is the full run's first 2, exactly; resumed from iteration 1's
    # checkpoint (.tmp: the directory while it is written), the train pool's critic is the one
    # saved there, weights and Adam state, on both of its ranks; the rollout rank held none
    a, b = _numbers(full), _numbers(resumed)
    assert a[:2] == b[:2], [(x["iteration"], k, x[k], y.get(k)) for x, y in zip(a, b)
                            for k in x if x[k] != y.get(k)]
    assert [h["iteration"] for h in resumed] == [0, 1, 2] and \
        all(math.isfinite(h["value_loss"]) for h in resumed)
    for rank, (*_, seen, _) in enumerate(results):
        assert ("critic copies: fresh, resumed", int(rank < 2), 0) in seen, seen
        seen = [x for x in seen if x[0] != "critic copies: fresh, resumed"]
        saved = {name: d for what, name, d in seen[:6] if what == "saved"}
        loaded = [(name, d) for what, name, d in seen if what == "loaded"]
        assert loaded[0][0] == "iter_000001", seen
        assert loaded[0][1] == saved["iter_000001.tmp"], (rank, seen)
        assert (loaded[0][1] is None) == (rank == 2), (rank, seen)
    # auto, forced: split, colocated (the world in DP3), split; the critic follows the policy
    assert [h["iteration"] for h in moved] == [0, 1, 2]
    where = [h["split"]["rollout_ranks"] if "split" in h else 0 for h in moved]
    critic = [h["critic_layout"] for h in moved]
    assert where == [1, 0, 1] and critic[1] == "DP3" and critic[0] == critic[2], (where, critic)
    for h in moved:
        assert all(math.isfinite(h[k]) for k in VALUE_KEYS), h
    # every batch sent is the batch trained (colocated runs at bound 0, so a move there may
    # drop a group restored past it, counted: trainer/colocated.py)
    sent, trained = sent_and_trained(read_audit(tmp_path / "audit_auto"))
    assert sorted(sent) == [0, 1, 2] and trained == sent, (sorted(sent), sorted(trained))
