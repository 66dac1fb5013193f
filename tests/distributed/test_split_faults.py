"""Split placement's faults on 4 gloo ranks (train pool dp2 on ranks 0-1, rollout pool dp2 on
ranks 2-3; trainer/split.py), each struck with a fault point (runtime/fault_points.py), so
the test hits the same moment on any machine speed:

- a stalled weight handoff: rollout rank 3 pauses at ``split.handoff`` of meeting 3 and never
  goes on; every other rank fails within ``cluster.weight_sync_timeout_s`` (5 s, the handoff's
  own group) rather than the world's collective timeout (120 s here), with ``HandoffFailed``
  naming the limit and the checkpoint a rerun resumes from (iteration 1: ``checkpoint_every=2``,
  so iteration 2 is trained again); that checkpoint exists and the rerun, fault disarmed,
  completes with every episode of the kept lineage trained exactly once;
- the failure's text in each case (a checkpoint at the meeting, an older one, none yet, a peer
  that died before the limit), without a world.

A stop during a rollout stage is struck in tests/distributed/test_split_trainer.py (the held
Connect Four).
"""

import json
import threading
import time

import pytest
from split_audit import check_exactly_once, check_handoffs, read_audit, sent_and_trained, \
    split_config, train_audited

from earl_megatron.runtime import fault_points
from earl_megatron.testing.multiproc import run_distributed

LIMIT_S = 5
WORLD_TIMEOUT_S = 120


def _cfg(out):
    return split_config(out, 4, 1, cluster={"weight_sync_timeout_s": LIMIT_S},
                        checkpoint_every=2)


def test_a_stalled_handoff_fails_within_its_timeout_naming_the_checkpoint_to_resume(
        tmp_path, monkeypatch):
    out, audit, faults = tmp_path / "run", tmp_path / "audit", tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv(fault_points.ENV, str(faults))
    ident = fault_points.arm(faults, "split.handoff", it=3, rank=3)
    hit: dict = {}

    def watch():   # the moment rank 3 stalls (after every rank reached the handoff)
        try:
            hit["info"] = fault_points.wait_hit(faults, "split.handoff", ident, 300)
            hit["at"] = time.monotonic()
        except TimeoutError:
            pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with pytest.raises(RuntimeError) as failed:
            run_distributed(train_audited, 4, _cfg(str(out)), str(audit), timeout=300,
                            collective_timeout_s=WORLD_TIMEOUT_S)
        failed_at = time.monotonic()
    finally:
        fault_points.release(faults, "split.handoff", ident)   # rank 3 is killed by now
        watcher.join(timeout=10)
    assert hit.get("info", {}).get("rank") == 3, hit
    # bounded by the handoff's own timeout, not the world's collective timeout
    waited = failed_at - hit["at"]
    print(f"failed {waited:.1f} s after the stall")
    assert LIMIT_S - 1 <= waited < LIMIT_S + 30 < WORLD_TIMEOUT_S, waited
    text = " ".join(str(failed.value).split())
    assert "HandoffFailed" in text, text
    assert ("split placement: the weight handoff at meeting 3 (the weights after iteration 2"
            in text), text
    assert f"did not complete within cluster.weight_sync_timeout_s={LIMIT_S} s" in text, text
    ckpt = out / "checkpoints" / "iter_000001"
    assert f"The last checkpoint is iteration 1 ({ckpt})" in text, text
    assert "it trains iteration 2 again" in text, text
    loop = json.loads((ckpt / "loop.json").read_text())
    assert loop["iteration"] == 1 and loop["pool"] is not None
    assert not (out / "checkpoints" / "iter_000002").exists()

    # what the failed run kept: iterations 0 and 1, each sent episode trained once
    rows = read_audit(audit)
    sent, trained = sent_and_trained(rows)
    assert sorted(trained) == [0, 1, 2] and sorted(sent) == [0, 1, 2, 3], (sent, trained)
    for it in (0, 1):
        assert trained[it] == sent[it] and sum(sent[it].values()) == 4, it

    # the rerun, fault disarmed (each arm fires once; nothing is armed now)
    monkeypatch.delenv(fault_points.ENV)
    audit2 = tmp_path / "audit2"
    hist = run_distributed(train_audited, 4, _cfg(str(out)), str(audit2), timeout=300,
                           collective_timeout_s=WORLD_TIMEOUT_S)[0]
    assert [h["iteration"] for h in hist] == [0, 1, 2, 3]
    rows2 = read_audit(audit2)
    check_exactly_once(rows2, 4, first=2)
    trained2 = sent_and_trained(rows2)[1]
    # the lineage: nothing the kept iterations trained is trained again
    kept = {d for it in (0, 1) for d in trained[it]}
    assert not kept & {d for c in trained2.values() for d in c}
    assert sorted(check_handoffs(rows2)) == [2, 3]


def test_the_handoff_failure_names_what_a_rerun_does_again():
    """HandoffFailed's text without a world: a checkpoint at the meeting (nothing lost), an
    older one, none yet, a failure before the limit."""
    from pathlib import Path
    from types import SimpleNamespace

    from earl_megatron.runtime.weight_transfer import WeightPlanError
    from earl_megatron.trainer.handoff import handoff_failure

    def text(saved, j, seconds=5.0, cause="Timed out waiting 5000ms for recv"):
        e = WeightPlanError(2, "bucket 1 of 3 (receiving from ranks [0], sending to ranks [])",
                            RuntimeError(cause))
        return handoff_failure(j, e, seconds, n_t=2, world=4, saved=saved, limit=5.0,
                               out=Path("/r"))

    t = text(2, 3)
    assert t.startswith("split placement: the weight handoff at meeting 3 (the weights after "
                        "iteration 2, train pool ranks 0-1 -> rollout pool ranks 2-3) did not "
                        "complete within cluster.weight_sync_timeout_s=5 s: rank 2, bucket 1 "
                        "of 3 (receiving from ranks [0], sending to ranks [])"), t
    assert "The last checkpoint is iteration 2 (/r/checkpoints/iter_000002)" in t, t
    assert "nothing trained is lost" in t and "raise cluster.weight_sync_timeout_s" in t, t
    assert "it trains iterations 1-3 again" in text(0, 4)
    t = text(-1, 0, seconds=0.2, cause="Connection closed by peer")
    assert "(the start's weights, " in t and "failed after 0.2 s" in t, t
    assert "No checkpoint was written yet: a rerun starts from iteration 0." in t, t
    assert "trains iteration 0 again" in text(-1, 1)
