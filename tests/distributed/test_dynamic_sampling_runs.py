"""DAPO's dynamic sampling through the trainer (2 ranks, rollout dp2, GRPO groups of 2, one
launch): 3 iterations synchronously (k = 0, through the episode pool) and 3 asynchronously
(k = 1). Every metrics line's counts add up (played = trained + dropped + carried; nothing
carried at k = 0), the groups trained are exactly the record's count, each whole and with
rewards that differ (read from the audit of what each replica trained), and no episode trains
twice."""

import json
import os
from collections import defaultdict

from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.testing.multiproc import run_distributed

G, BATCH = 2, 4
CASES = {"k0": (0, 2, 0), "k1": (1, 2, 0), "k0-no-rounds": (0, 0, 1)}
"""(max_staleness, dynamic_sampling_rounds, run.seed): without extra rounds a batch can end
with no group with signal (seed 1: iterations 0 and 1), whose train step is skipped."""


def _cfg(out, k, rounds=2, seed=0):
    return tiny_connect_four(
        out, env={"eval_opponents": []},
        rollout={"episodes_per_iteration": BATCH, "max_turns": 1},
        algorithm={"name": "grpo", "group_size": G, "micro_batch_size": 2,
                   "dynamic_sampling": True, "dynamic_sampling_rounds": rounds,
                   "max_staleness": k},
        run={"iterations": 3, "seed": seed})


def _both(root):
    from earl_megatron.train import run

    for case, (k, rounds, seed) in CASES.items():
        os.environ["EARL_SPLIT_AUDIT"] = f"{root}/audit-{case}"
        run(_cfg(f"{root}/{case}", k, rounds, seed))
    return True


def _trained(audit_dir):
    """{iteration: [(sample id, reward, digest)]} over every replica leader's train rows."""
    out = defaultdict(list)
    for f in sorted(os.listdir(audit_dir)):
        for line in open(os.path.join(audit_dir, f)):
            row = json.loads(line)
            if row["side"] == "train" and "ids" in row:
                out[row["it"]] += list(zip(row["ids"], row["rewards"]))
    return out


def test_dynamic_sampling_drops_flat_groups_and_counts_them(tmp_path):
    run_distributed(_both, 2, str(tmp_path), timeout=900)
    totals = defaultdict(int)
    for k, (staleness, rounds, _) in CASES.items():
        lines = [json.loads(x) for x in (tmp_path / k / "metrics.jsonl")
                 .read_text().splitlines()]
        print(k, [[r[f"dynamic_{x}"] for x in ("groups_played", "groups_dropped",
                                               "groups_trained", "groups_carried", "rounds")]
                  for r in lines])
        assert [r["iteration"] for r in lines] == [0, 1, 2], k
        trained = _trained(tmp_path / f"audit-{k}")
        for r in lines:
            played, dropped = r["dynamic_groups_played"], r["dynamic_groups_dropped"]
            done, carried = r["dynamic_groups_trained"], r["dynamic_groups_carried"]
            assert played == done + dropped + carried, (k, r)
            assert done <= BATCH // G and r["dynamic_rounds"] <= rounds, (k, r)
            if staleness == 0:
                assert carried == 0, r
            # the trained samples: exactly the record's groups, whole, each with signal
            rows = trained.get(r["iteration"], [])
            by_group = defaultdict(list)
            for s, reward in rows:
                by_group[s // G].append(reward)
            assert len(by_group) == done, (k, r["iteration"], rows)
            for rewards in by_group.values():
                assert len(rewards) == G and max(rewards) != min(rewards), (k, rows)
            if done == 0:
                assert r["skipped"] and "loss" not in r, r
            else:
                assert "skipped" not in r and r["advantage_group_mean_max"] < 1e-6, r
            for key in ("dropped", "trained"):
                totals[f"{key}{k}"] += r[f"dynamic_groups_{key}"]
    # the runs are deterministic (fixed seeds): each dropped and trained groups
    assert all(totals[f"{w}{k}"] > 0 for w in ("dropped", "trained") for k in CASES), totals
