"""Split placement with SGLang servers on the rollout pool (opt-in: EARL_SGLANG_VENV).

Three ranks: the train pool is ranks 0-1 in tp2, the rollout pool rank 2 in dp1, leading one tp1
server that holds no Megatron model. The server starts from config.json alone; at every handoff
the train pool assembles each bucket of the full weights at rank 2 by the weight plan (rows from
both tp halves, point to point), and rank 2 pushes them into its server after the meeting. The
test strikes the server at two named fault points (the rank pauses there until struck, so every
machine speed sees the same sequence):

    sglang.push      SIGKILL during the push of it2 (after meeting 1) -> restarted, push replayed
    sglang.generate  SIGKILL during stage 2's rollout (it2)           -> restarted, turn resubmitted

Checked:
- every episode the rollout pool handed over was trained exactly once, in the step after its
  meeting, and no trained token is older than k = 1 (the trainer's audit and records);
- after every handoff the weights the server holds, read back by name (/get_weights_by_name),
  equal the train pool's weights under HF names, bit for bit (fp32), the restarted server's
  included;
- the server's leader received the whole model once per handoff and nobody else received any;
  every record names the server and the version it sampled with (stages 0 and 1 under the
  start's weights it1, the train pool training batch 0 meanwhile; stage 2 under it2);
- both strikes were followed by a start on a new port, the restart reasons name the push and the
  request, and after the run every server process group is gone.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from strikes import kill, striking

from earl_megatron.runtime import fault_points
from earl_megatron.testing.multiproc import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from split_audit import (check_exactly_once, read_audit, split_config,  # noqa: E402
                         train_audited)

pytestmark = pytest.mark.timeout(2400)  # server starts take minutes on 2 busy cores


def test_split_placement_on_sglang_servers(sglang_python, run_dir, group_gone, monkeypatch):
    out, audit = run_dir / "run", run_dir / "audit"
    points = run_dir / "fault-points"
    points.mkdir()
    monkeypatch.setenv(fault_points.ENV, str(points))  # the ranks inherit it
    log_dir = str(out / "sglang" / "logs-TP1-dp0")
    plan = [("sglang.push", {"log_dir": log_dir, "version": "it2"}, kill),
            ("sglang.generate", {"log_dir": log_dir, "version": "it2"}, kill)]
    cfg = split_config(str(out), 3, 1, cluster={
        # a dead server restarts within server_start_timeout_s; the handoff never waits for it
        "collective_timeout_s": 900, "server_start_timeout_s": 300,
        "server_request_timeout_s": 30, "weight_sync_timeout_s": 60,
        "server_max_restarts": 2}, checkpoint_every=0)
    d = cfg.to_dict()
    d["layout"].update(train="tp2", logprob="tp2", rollout="dp1")
    d["rollout"].update(pool_ranks=1, engine="sglang", sglang_python=sglang_python,
                        sglang_device="cpu", sglang_bucket_mb=0.1)
    cfg = type(cfg).from_dict(d)
    with striking(points, plan) as struck:
        run_distributed(train_audited, 3, cfg, str(audit), timeout=2100,
                        collective_timeout_s=cfg.cluster.collective_timeout_s)

    rows = read_audit(audit)
    check_exactly_once(rows, 3)
    # weights: the start's handoff and meetings 1 and 2 (meeting 3 ends the run)
    held = {}
    for r in rows:
        if r["side"] == "weights":
            held.setdefault(r["it"], {})[r["pool"]] = r
    assert sorted(held) == [0, 1, 2], held
    for it, pools in held.items():
        assert pools["rollout"]["rank"] == 2 and pools["train"]["rank"] == 0, pools
        assert pools["rollout"]["names"] == pools["train"]["names"] > 5, pools
        assert pools["rollout"]["sha256"] == pools["train"]["sha256"], it

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
             if x.strip()]
    lines = [x for x in lines if "iteration" in x]
    print(json.dumps([{k: x.get(k) for k in ("iteration", "rollout_weight_version",
                                             "rollout_push_s", "rollout_servers_died",
                                             "staleness_shares", "split")} for x in lines],
                     indent=1))
    assert [x["iteration"] for x in lines] == [0, 1, 2]
    assert [x["rollout_weight_version"] for x in lines] == ["it1", "it1", "it2"]
    for x in lines:
        assert x["rollout_engine"] == "sglang" and len(x["rollout_servers"]) == 1, x
        assert "(rank 2)" in x["rollout_servers"][0]
        assert x["staleness_max"] <= 1 and x["pool_dropped"] == 0, x
        assert x["split"]["rollout_ranks"] == 1 and x["layouts"]["train"] == "TP2", x
        # the leader received the whole model at the handoff, in buckets of <= 100 KiB
        assert x["weight_sync_bytes_in_leader"] == x["rollout_push_bytes"] > 0, x
        assert x["rollout_push_buckets"] > 3 and \
            x["rollout_push_bucket_max_bytes"] <= 0.1 * 2**20, x
    assert lines[-1]["rollout_servers_died"] >= 2
    assert lines[1]["staleness_shares"] == {"1": 1.0}
    # no copy of the model was written for the server
    files = [p for p in (out / "sglang").rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    # each strike was followed by a start on a new port, for the reason it was struck
    log = (out / "sglang" / "logs-TP1-dp0" / "server-0.log").read_text()
    pids = [int(x) for x in re.findall(r"=== pid (\d+)", log)]
    for _, _, pid in struck:
        assert pid in pids and pids.index(pid) < len(pids) - 1, (struck, pids)
    ports = re.findall(r"start: .* --port (\d+)", log)
    assert len(ports) == len(pids) == 3 and len(set(ports)) == 3, ports
    reasons = re.findall(r"=== restart after: (.*)", log)
    assert any(r.startswith("weight push") for r in reasons), reasons
    assert len(reasons) == 2, reasons
    for pid in pids:
        assert group_gone(pid), pid
