"""Split placement's train pool switches its policy (and the KL reference lives) in LOGPROB's
layout and trains in TRAIN's, every iteration, while the rollout pool plays (issue #43).

One 3-rank launch runs two splits in turn, train pool ranks 0-1 and rollout pool rank 2 (dp1),
Connect Four, k = 1, KL in the loss, 3 iterations:

- switching: ``layout.logprob=dp2``, ``layout.train=tp2``: the batch arrives in dp2, is
  re-scored there (old logprobs) and by the reference (built in dp2, its groups made by the
  train pool alone), the policy switches to tp2 in memory and trains, and the handoff reads its
  tp2 shards;
- the same run with LOGPROB in TRAIN's layout (tp2 both), where nothing switches.

The switching run trains every episode the rollout pool sent exactly once, after every handoff
the rollout pool's weights equal the train pool's bit for bit, its records name both layouts
and time the two switches, and the switch changes no number: loss, KL, the re-scored logprobs'
distance to the engine's, per iteration, equal the other run's within 1e-5. At lr = 1e-12: this
tiny run's batches carry no reward signal (every advantage 0), and Adam turns the ~1e-7 by which
two layouts' scores differ (grad norm 9e-8 against exactly 0) into a full step, so at a real
learning rate the runs part after step 0 for a reason that is not the switch. At 1e-12 a step
moves no number, yet every iteration switches the weights and Adam state TRAIN -> LOGPROB ->
TRAIN and scores and trains on them (the switcher's exactness with a moving optimizer is
tests/distributed/test_switcher.py's).
"""

import math

from earl_megatron.testing.configs import tiny_connect_four
from split_audit import check_exactly_once, check_handoffs, read_audit, train_audited

COMPARED = ("loss", "kl", "rollout_logprob_diff", "rollout_logprob_diff_max", "grad_norm")


def _cfg(out, logprob):
    return tiny_connect_four(
        out, layout={"rollout": "dp1", "logprob": logprob, "train": "tp2"},
        rollout={"placement": "split", "pool_ranks": 1},
        algorithm={"name": "grpo", "group_size": 2, "micro_batch_size": 2,
                   "max_staleness": 1, "off_policy": "decoupled", "old_logprobs": "recompute",
                   "kl_mode": "loss", "kl_coef": 0.1, "lr": 1e-12},
        env={"eval_opponents": []}, run={"iterations": 3})


def _both(root):
    """On every rank: the switching run, then the one that does not switch."""
    return [train_audited(_cfg(str(root / name / "run"), logprob), str(root / name / "audit"))
            for name, logprob in (("switch", "dp2"), ("same", "tp2"))]


def test_train_pool_switches_between_logprob_and_train_layouts(tmp_path):
    from earl_megatron.testing.multiproc import run_distributed

    switched, same = run_distributed(_both, 3, tmp_path, timeout=900)[0]
    assert [h["iteration"] for h in switched] == [0, 1, 2]
    for h in switched:
        assert h["layouts"] == {"rollout": "TP1", "logprob": "DP2", "train": "TP2"}, h
        assert h["seconds"]["plan+switch"] > 0 and h["seconds"]["switch"] > 0, h["seconds"]
        assert h["staleness_max"] <= 1
    assert all(h["layouts"]["logprob"] == h["layouts"]["train"] == "TP2" for h in same)
    for a, b in zip(switched, same):
        for key in COMPARED:
            assert math.isclose(a[key], b[key], rel_tol=0, abs_tol=1e-5), (a["iteration"], key,
                                                                            a[key], b[key])
    rows = read_audit(tmp_path / "switch" / "audit")
    check_exactly_once(rows, 3, per_batch=8)
    weights = check_handoffs(rows)   # the start's, then each step's
    assert sorted(weights) == [0, 1, 2], sorted(weights)
