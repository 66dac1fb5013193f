"""Split placement's test helpers (tests/distributed/test_split_*.py): the 4-rank configuration
(train pool dp2 = ranks 0-1, rollout pool dp2 = ranks 2-3, Connect Four, 4 episodes a batch) and
the trainer's audit (``EARL_SPLIT_AUDIT``, trainer/split.py) read back and checked.

An audit row is one of: ``sent`` (a rollout replica leader's batch at a meeting: pool keys,
episode digests, dropped), ``train`` (a train stage; its replica leader's rows carry the digests
it trained), ``rollout`` (a stage's start and end) and ``weights`` (each pool's weights hashed
after a handoff)."""

import json
from collections import Counter

from earl_megatron.config.train import TrainConfig


def split_config(out, iterations, k, *, cluster=None, **run) -> TrainConfig:
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "dp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": []},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4, "placement": "split",
                    "pool_ranks": 2},
        "algorithm": {"name": "grpo", "group_size": 2, "micro_batch_size": 2,
                      "old_logprobs": "recompute", "off_policy": "decoupled",
                      "max_staleness": k},
        **({"cluster": cluster} if cluster else {}),
        "run": {"iterations": iterations, "output_dir": out, "eval_episodes": 2,
                "live_view": False, **run},
    })


def train_audited(cfg, audit):
    """On every rank: the trainer's run, auditing into ``audit``."""
    import os
    os.environ["EARL_SPLIT_AUDIT"] = audit
    from earl_megatron.train import run
    return run(cfg)


def train_scheduled(cfg, audit, schedule):
    """The trainer with auto's n-th decision (rank 0: the start, then each re-plan) forced to
    ``schedule[n]`` rollout ranks (0: colocated; the last entry repeats) through the planner's
    own fixed-split plan (the choice itself is tests/unit/test_split_plan.py's): the moves'
    mechanism on any machine, whatever the rates it measures."""
    from earl_megatron.plan.split import plan_split
    from earl_megatron.trainer.auto import Auto

    calls = []

    def propose(self, lengths, rates, env_seconds=0.0):
        n = schedule[min(len(calls), len(schedule) - 1)]
        calls.append(n)
        wp = self.planner
        wp.last_lengths = list(lengths)
        return plan_split(wp.selector, wp.split_workload(env_seconds), rollout_ranks=n,
                          current=self.plan)

    Auto.propose = propose
    return train_audited(cfg, audit)


def read_audit(d) -> list[dict]:
    rows = []
    for f in sorted(d.glob("rank*.jsonl")):
        rank = int(f.stem[4:])
        rows += [dict(json.loads(x), rank=rank) for x in f.read_text().splitlines()]
    return rows


def sent_and_trained(rows) -> tuple[dict, dict]:
    """Per iteration, the digests the rollout pool sent and those the train pool trained."""
    sent, trained = {}, {}
    for r in rows:
        if r["side"] == "sent":
            sent.setdefault(r["it"], Counter()).update(r["digests"])
        elif r["side"] == "train" and "digests" in r:
            trained.setdefault(r["it"], Counter()).update(r["digests"])
    return sent, trained


def check_exactly_once(rows, iterations, first=0, per_batch=4) -> None:
    """Iterations ``first .. iterations - 1`` each sent a whole batch and trained exactly it;
    no pool key was sent twice and nothing was dropped."""
    sent, trained = sent_and_trained(rows)
    assert sorted(sent) == list(range(first, iterations)), sorted(sent)
    assert sorted(trained) == list(range(first, iterations)), sorted(trained)
    for it in sent:
        # each train replica's leader trains its block: every sent episode once, nothing else
        assert trained[it] == sent[it], it
        assert sum(sent[it].values()) == per_batch
    keys = Counter(tuple(k) for r in rows if r["side"] == "sent" for k in r["keys"])
    assert max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]
    assert all(r["dropped"] == 0 for r in rows if r["side"] == "sent")


def check_handoffs(rows) -> dict:
    """After every handoff the two pools' weights hash equal; {meeting: {pool: sha256}}."""
    by_it = {}
    for r in rows:
        if r["side"] == "weights":
            by_it.setdefault(r["it"], {})[r["pool"]] = r["sha256"]
    assert by_it
    for it, pools in by_it.items():
        assert set(pools) == {"train", "rollout"}, (it, pools)
        assert pools["train"] == pools["rollout"], it
    return by_it
