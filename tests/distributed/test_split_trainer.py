"""Split placement's trainer on 4 gloo ranks: train pool dp2 (ranks 0-1), rollout pool dp2
(ranks 2-3), trainer/split.py.

- every episode the rollout pool hands over is trained exactly once, in the next step, and
  nothing is dropped; no trained token is older than k (and at k=1 every one is exactly one
  version old after the first batch);
- after every handoff the rollout pool's weights equal the train pool's, bit for bit;
- the rollout of batch j+1 and the training of batch j overlap in time;
- a checkpoint and a resume: the resumed run trains each episode exactly once too.
"""

import json
from collections import Counter

from split_audit import check_exactly_once, check_handoffs, read_audit, split_config, \
    train_audited, train_scheduled

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed


def test_split_k1_trains_every_episode_once_one_version_behind(tmp_path):
    audit = tmp_path / "audit"
    hist = run_distributed(train_audited, 4, split_config(str(tmp_path / "run"), 4, 1),
                           str(audit), timeout=500)[0]
    assert [h["iteration"] for h in hist] == [0, 1, 2, 3]
    rows = read_audit(audit)
    check_exactly_once(rows, 4)
    weights = check_handoffs(rows)
    assert sorted(weights) == [0, 1, 2, 3], sorted(weights)   # the start's, then each step's
    for j in range(1, 4):   # a step with a gradient changed the weights it handed over
        if hist[j - 1]["grad_norm"] > 0:
            assert weights[j]["train"] != weights[j - 1]["train"], j
    assert any(h["grad_norm"] > 0 for h in hist[:3])
    # stage 0 plays the start's weights (lag 0); from then on every token is one step old
    assert hist[0]["staleness_shares"] == {"0": 1.0}
    for h in hist[1:]:
        assert h["staleness_shares"] == {"1": 1.0}, h["staleness_shares"]
    for h in hist:
        assert h["staleness_max"] <= 1 and h["pool_dropped"] == 0
        assert h["layouts"] == {"rollout": "DP2", "logprob": "DP2", "train": "DP2"}
        assert h["split"]["handoff_bytes"] > 0 or h["iteration"] == 0
    # the rollout of batch j + 1 ran while batch j trained
    stages = {(r["side"], r["it"]): r for r in rows if r["side"] in ("rollout", "train")}
    for j in range(3):
        roll, train = stages[("rollout", j + 1)], stages[("train", j)]
        assert roll["start"] < train["end"] and train["start"] < roll["end"], j
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1, 2, 3]


def test_split_k2_checkpoints_and_resumes_without_losing_an_episode(tmp_path):
    audit, out = tmp_path / "audit", tmp_path / "run"
    first = run_distributed(train_audited, 4, split_config(str(out), 2, 2, checkpoint_every=1),
                            str(audit), timeout=500)[0]
    assert [h["iteration"] for h in first] == [0, 1]
    loop = json.loads((out / "checkpoints" / "iter_000001" / "loop.json").read_text())
    assert loop["placement"] == {"train": "DP2", "rollout": "DP2"}
    assert loop["pool"] is not None
    rows = read_audit(audit)
    check_exactly_once(rows, 2)
    check_handoffs(rows)
    audit2 = tmp_path / "audit2"
    hist = run_distributed(train_audited, 4, split_config(str(out), 4, 2, checkpoint_every=1),
                           str(audit2), timeout=500)[0]
    assert [h["iteration"] for h in hist] == [0, 1, 2, 3]
    rows2 = read_audit(audit2)
    check_exactly_once(rows2, 4, first=2)
    check_handoffs(rows2)
    # no episode trained before the checkpoint is trained again after it
    before = Counter(d for r in rows if r["side"] == "train" and "digests" in r
                     for d in r["digests"])
    after = Counter(d for r in rows2 if r["side"] == "train" and "digests" in r
                    for d in r["digests"])
    assert not set(before) & set(after)
    for h in hist:
        assert h["staleness_max"] <= 2 and h["pool_dropped"] == 0


def test_split_stop_during_a_rollout_checkpoints_both_pools_then_resumes(tmp_path):
    """k=2, Connect Four held once two iterations are recorded (earl_megatron/testing/envs.py:
    the rollout pool's steps wait for the stop request, so it lands inside a rollout stage on
    any machine). The stage is abandoned, the meeting agrees to stop, the last trained
    iteration is checkpointed with the pool as it was before the abandoned stage; the resumed
    run trains the rest, every episode exactly once over both runs."""
    import threading
    import time

    audit, out = tmp_path / "audit", tmp_path / "run"
    metrics, release = out / "metrics.jsonl", tmp_path / "release"
    cfg = split_config(str(out), 5, 2, checkpoint_every=0).to_dict()
    cfg["env"] = {"name": "earl_megatron.testing.envs:held_connect_four", "eval_opponents": [],
                  "kwargs": {**cfg["env"]["kwargs"], "hold_when": str(metrics),
                             "hold_lines": 2, "release_when": str(release)}}
    done = threading.Event()

    def request_stop():
        while not done.is_set():
            if metrics.exists() and metrics.read_text().count("\n") >= 2:
                (out / "stop").write_text("requested\n")
                return
            time.sleep(0.02)

    stopper = threading.Thread(target=request_stop)
    stopper.start()
    try:
        first = run_distributed(train_audited, 4, TrainConfig.from_dict(cfg), str(audit),
                                timeout=500)[0]
    finally:
        done.set()
        stopper.join()
    stopped = (out / "stop").read_text()
    assert stopped.startswith("stopped "), stopped
    last = int(stopped.split()[1])
    assert last in (1, 2), stopped   # the stage held: 2 or 3, whichever ran when line 2 landed
    assert [h["iteration"] for h in first] == list(range(last + 1))
    loop = json.loads((out / "checkpoints" / f"iter_{last:06d}" / "loop.json").read_text())
    assert loop["iteration"] == last and loop["pool"] is not None
    # nothing the abandoned stage started is in the checkpoint's pool
    assert all(e["key"][0] <= last for e in loop["pool"]["entries"]), loop["pool"]["entries"]
    rows = read_audit(audit)
    check_exactly_once(rows, last + 1)
    check_handoffs(rows)

    release.write_text("")
    (out / "stop").unlink()
    audit2 = tmp_path / "audit2"
    hist = run_distributed(train_audited, 4, TrainConfig.from_dict(cfg), str(audit2),
                           timeout=500)[0]
    assert [h["iteration"] for h in hist] == list(range(5))
    rows2 = read_audit(audit2)
    check_exactly_once(rows2, 5, first=last + 1)
    before = {d for r in rows if r["side"] == "train" and "digests" in r for d in r["digests"]}
    after = {d for r in rows2 if r["side"] == "train" and "digests" in r for d in r["digests"]}
    assert not before & after
    for h in hist:
        assert h["staleness_max"] <= 2 and h["pool_dropped"] == 0


def _auto_cfg(out, iterations):
    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "auto"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": []},
        "rollout": {"episodes_per_iteration": 8, "max_turns": 4, "placement": "auto"},
        "algorithm": {"name": "grpo", "group_size": 2, "micro_batch_size": 2,
                      "old_logprobs": "recompute", "off_policy": "decoupled",
                      "max_staleness": 1},
        "run": {"iterations": iterations, "output_dir": out, "eval_episodes": 2,
                "live_view": False, "checkpoint_every": 0},
    })


def test_auto_plans_the_split_and_moves_the_pools_without_losing_an_episode(tmp_path):
    audit, out = tmp_path / "audit", tmp_path / "run"
    hist = run_distributed(train_scheduled, 4, _auto_cfg(str(out), 5), str(audit), [2, 1],
                           timeout=500)[0]
    assert [h["iteration"] for h in hist] == list(range(5))
    ranks = [h["split"]["rollout_ranks"] for h in hist]
    # the first meeting that re-plans is meeting 1: iteration 0 trained on the first pools,
    # iteration 1's batch was played again on the new ones
    assert ranks[0] != ranks[1], ranks
    assert all("rollout" in h["split"]["plan"] for h in hist), hist[0]["split"]
    assert all(h["layouts"]["train"] and h["layouts"]["rollout"] for h in hist)
    loop = json.loads((out / "checkpoints" / "iter_000000" / "loop.json").read_text())
    assert loop["iteration"] == 0   # the move's checkpoint (checkpoint_every=0)
    rows = read_audit(audit)
    # exactly once across the move: the batch of the abandoned stage 1 was never sent
    check_exactly_once(rows, 5, per_batch=8)
    check_handoffs(rows)
    for h in hist:
        assert h["staleness_max"] <= 1 and h["pool_dropped"] == 0


def test_auto_moves_between_split_and_colocated_without_losing_an_episode(tmp_path):
    """auto weighs the colocated loop beside every split: start colocated (nothing measured),
    move after stage 0's rollout, before anything trained, to a split of 2 rollout ranks
    (no checkpoint: stage 0 plays again there), to colocated at meeting 2 (stage 2 played again
    there), back to a split of 1 rollout rank before stage 4; every episode sent is trained
    exactly once across the three moves, and each move's seconds are in the record of the
    iteration it delayed."""
    audit, out = tmp_path / "audit", tmp_path / "run"
    hist = run_distributed(train_scheduled, 4, _auto_cfg(str(out), 5), str(audit),
                           [0, 2, 2, 0, 0, 1], timeout=600)[0]
    assert [h["iteration"] for h in hist] == list(range(5))
    where = [h["split"]["rollout_ranks"] if "split" in h else 0 for h in hist]
    assert where == [2, 2, 0, 0, 1], where
    moved = [h["iteration"] for h in hist if "move" in h["seconds"]]
    assert moved == [0, 2, 4], moved
    assert all(h["seconds"]["total"] > h["seconds"]["move"] > 0 for h in hist
               if "move" in h["seconds"])
    saved = sorted(p.name for p in (out / "checkpoints").glob("iter_*"))
    assert saved[:2] == ["iter_000001", "iter_000003"], saved   # none before anything trained
    for it in (1, 3):   # the moves' checkpoints (checkpoint_every=0)
        loop = json.loads((out / "checkpoints" / f"iter_{it:06d}" / "loop.json").read_text())
        assert loop["iteration"] == it
    rows = read_audit(audit)
    check_exactly_once(rows, 5, per_batch=8)
    for h in hist:
        assert h["staleness_max"] <= 1 and h["pool_dropped"] == 0
