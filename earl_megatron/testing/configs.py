"""The tests' small training run: the tiny model on Connect Four against random, rollout DP2
(each rank plays half the episodes, so every statistic must be all-reduced), LOGPROB and TRAIN
on TP2, 8 episodes of at most 3 turns, 2 iterations, no checkpoints but the last, a 2-episode
evaluation. ``tiny_connect_four(out, algorithm={...}, run={...})`` changes only the keys given
(merged per section), so each test states what it is about."""

from __future__ import annotations

from earl_megatron.config.train import TrainConfig


def tiny_connect_four(out: str, **sections: dict) -> TrainConfig:
    base = {
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "tp2", "train": "tp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "",
                                                    "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 8, "max_turns": 3},
        "algorithm": {"micro_batch_size": 4},
        "run": {"iterations": 2, "output_dir": out, "checkpoint_every": 0, "eval_episodes": 2,
                "live_view": False},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return TrainConfig.from_dict(base)
