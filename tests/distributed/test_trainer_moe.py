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
"""

import dataclasses
import json

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed

LAYOUTS = {"rollout": "EP2xDP2", "train": "TP2"}  # no KL: the re-scoring runs in ROLLOUT's


def _cfg(out, iterations, replay=True):
    model = {k: v for k, v in dataclasses.asdict(ModelConfig.tiny("qwen3_moe")).items()
             if k != "vocab_size"}
    return TrainConfig.from_dict({
        "model": {**model, "vocab_size": 32},
        "layout": {"mode": "static", "rollout": "ep2", "logprob": "tp2", "train": "tp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"micro_batch_size": 2, "old_logprobs": "recompute",
                      "routing_replay": replay},
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
