"""The trainer end to end with the tiny Qwen3-MoE (4 experts of width 32, top 2) on 2 ranks.

One launch runs four trainings (static layouts: ROLLOUT in EP2xDP2, the experts split over the
two replicas; TRAIN in TP2 under sequence parallelism, so every iteration switches layouts and
moves the experts between an EP2 and a TP2 placement), with routing replay on
(algorithm.routing_replay: the rollout's experts replayed in the re-scoring and TRAIN forwards):
- 2 iterations uninterrupted;
- 1 iteration, then the same output directory resumed for a second one from its checkpoint:
  its metrics equal the uninterrupted run's, line for line;
- 2 iterations without routing replay, for the logprob mismatch without it.
The embedded engine's logprobs are checked against the trainer's re-scoring in the EP2 rollout
layout (algorithm.old_logprobs=recompute): the same Megatron model, KV-cached against a full
forward, so only numerics separate them (fp32: < 1e-4 with or without replay).

A second launch runs routing replay with episodes in flight (algorithm.max_staleness=1,
decoupled PPO): 3 iterations uninterrupted, and 1 iteration then a resume to 3, whose
checkpoints hold live episodes with their experts (trainer/episode_pool.py).
"""

import dataclasses
import json

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed

LAYOUTS = {"rollout": "EP2xDP2", "train": "TP2"}  # no KL: the re-scoring runs in ROLLOUT's


def _cfg(out, iterations, replay=True, **algorithm):
    model = {k: v for k, v in dataclasses.asdict(ModelConfig.tiny("qwen3_moe")).items()
             if k != "vocab_size"}
    return TrainConfig.from_dict({
        "model": {**model, "vocab_size": 32},
        "layout": {"mode": "static", "rollout": "ep2", "logprob": "tp2", "train": "tp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"micro_batch_size": 2, "old_logprobs": "recompute",
                      "routing_replay": replay, **algorithm},
        "run": {"iterations": iterations, "output_dir": out, "checkpoint_every": 1,
                "eval_every": 0, "eval_episodes": 2, "live_view": False},
    })


def _four_runs(root):
    from earl_megatron.train import run

    full = run(_cfg(f"{root}/full", 2))
    first = run(_cfg(f"{root}/part", 1))
    resumed = run(_cfg(f"{root}/part", 2))
    free = run(_cfg(f"{root}/free", 2, replay=False))
    return full, first, resumed, free


def _strip(history):
    return [{k: v for k, v in h.items() if k != "seconds"} for h in history]


def test_moe_trains_switches_layouts_and_resumes(tmp_path):
    full, first, resumed, free = run_distributed(_four_runs, 2, str(tmp_path), timeout=600)[0]
    assert [h["iteration"] for h in full] == [0, 1]
    assert all(h["layouts"] == LAYOUTS for h in full), [h["layouts"] for h in full]
    lines = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in lines] == [0, 1] and len(first) == 1
    assert _strip(lines) == _strip(full)
    assert list((tmp_path / "part" / "checkpoints").glob("iter_*"))
    for h, f in zip(full, free):
        print(f"MoE iteration {h['iteration']}: rollout_logprob_diff (max) with routing replay "
              f"{h['rollout_logprob_diff']:.2e} ({h['rollout_logprob_diff_max']:.2e}), without "
              f"{f['rollout_logprob_diff']:.2e} ({f['rollout_logprob_diff_max']:.2e})")
        assert 0 <= h["rollout_logprob_diff"] <= h["rollout_logprob_diff_max"] < 1e-4, h
        assert 0 <= f["rollout_logprob_diff"] <= f["rollout_logprob_diff_max"] < 1e-4, f
    # iteration 0 samples the same episodes with and without replay (same seeds, same weights):
    # replaying the experts it recorded cannot make the re-scoring further from the engine's
    assert full[0]["win_rate"] == free[0]["win_rate"]
    assert full[0]["rollout_logprob_diff_max"] <= free[0]["rollout_logprob_diff_max"] + 1e-6
    # the optimizer step moved the policy: iteration 1 plays other logprobs than iteration 0
    assert full[0]["grad_norm"] > 0


ASYNC = {"max_staleness": 1, "off_policy": "decoupled"}


def _async_runs(root):
    from earl_megatron.train import run

    full = run(_cfg(f"{root}/full", 3, **ASYNC))
    first = run(_cfg(f"{root}/part", 1, **ASYNC))
    resumed = run(_cfg(f"{root}/part", 3, **ASYNC))
    return full, first, resumed


def _pool(root, run, it):
    loop = json.loads((root / run / "checkpoints" / f"iter_{it:06d}" / "loop.json").read_text())
    return {tuple(e["key"]): e for e in loop["pool"]["entries"]}


def _routes_of(entry):
    from earl_megatron.rollout.routing_replay import from_json

    held = entry["live"] if entry["live"] is not None else entry["episode"]
    return from_json(held["routes"]), len(held["tokens" if entry["live"] else "token_ids"])


def test_moe_routing_replay_with_episodes_in_flight_resumes(tmp_path):
    full, first, resumed = run_distributed(_async_runs, 2, str(tmp_path), timeout=900)[0]
    assert [h["iteration"] for h in full] == [0, 1, 2] and len(first) == 1
    for h in full:
        print(f"MoE k=1 iteration {h['iteration']}: staleness max {h['staleness_max']}, "
              f"carried {h['pool_carried']}, rollout_logprob_diff (max) "
              f"{h['rollout_logprob_diff']:.2e} ({h['rollout_logprob_diff_max']:.2e}), "
              f"off_policy_weight_mean {h['off_policy_weight_mean']:.4f}")
        assert h["staleness_max"] <= 1 and h["pool_dropped"] == 0, h
        assert 0 <= h["rollout_logprob_diff"] <= h["rollout_logprob_diff_max"], h
        assert 0 <= h["off_policy_capped_fraction"] <= 1
        if not h["pool_carried"]:
            # no episode re-prefilled under newer weights: the replay reproduces the engine's
            # experts for every token, so only numerics separate the logprobs (as at k=0)
            assert h["rollout_logprob_diff_max"] < 1e-4, h
    # a carried episode's older tokens replay the experts they were sampled with, while the
    # engine re-prefilled them under the newer weights with its own choice (docs/moe.md)
    assert full[0]["pool_carried"] == 0 and any(h["pool_carried"] > 0 for h in full)
    assert any(h["staleness_max"] == 1 for h in full), [h["staleness_shares"] for h in full]
    # the checkpoint after iteration 0 holds episodes in flight, each with its experts
    before = _pool(tmp_path, "part", 0)
    live = [k for k, e in before.items() if e["live"] is not None]
    assert live, "no episode was in flight at the checkpoint"
    cfg = _cfg("unused", 1)
    for k, e in before.items():
        routes, tokens = _routes_of(e)
        assert routes is not None and routes.shape[1:] == (cfg.model.num_layers,
                                                           cfg.model.moe_router_topk), k
        assert 0 < routes.shape[0] < tokens and 0 <= int(routes.min()) and \
            int(routes.max()) < cfg.model.num_experts, k
    # ... equal to the uninterrupted run's. At k=1 each of them trains in iteration 1 (none is
    # left at the next checkpoint), on the routes restored from that checkpoint: had the resume
    # lost them, the engine's re-prefill under version 1 would have given other experts for
    # their older tokens and iteration 1's rollout_logprob_diff and loss would differ from the
    # uninterrupted run's (they differ by 6.6e-4 here between the two routings)
    assert before == _pool(tmp_path, "full", 0)
    after = _pool(tmp_path, "part", 1)
    assert after == _pool(tmp_path, "full", 1)
    assert all(k[0] == 0 for k in before) and not set(before) & set(after)
    lines = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in lines] == [0, 1, 2]
    assert _strip(lines) == _strip(full) and _strip(resumed) == _strip(full)
