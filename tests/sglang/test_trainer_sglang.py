"""The trainer with rollout.engine=sglang on real CPU servers (opt-in: EARL_SGLANG_VENV).

One 2-rank run of 3 iterations, rollout layout dp2 (two tp1 servers), train layout tp2. Servers
start from config.json alone (--load-format dummy) and get the trainer's weights by the
distributed update. While it runs, the test strikes the servers at five points, each at a
named fault point (earl_megatron/runtime/fault_points.py: the trainer pauses there until the
test has struck), never after a sleep, so every machine speed sees the same sequence:

    1 sglang.start     SIGKILL while the first server starts     -> started again, new port
    2 sglang.group     SIGKILL while the weight group forms       -> restarted, group rejoined
    3 sglang.push      SIGKILL during the first weight push       -> restarted, push replayed
    4 sglang.generate  SIGKILL during the rollout of it2          -> restarted, turn resubmitted
    5 sglang.generate  SIGSTOP of its scheduler, the same rollout -> the request stalls past
                       cluster.server_request_timeout_s: restarted like a dead one

1-4 strike rank 0's server in turn; 5 strikes rank 1's beside 4, so its wait for the timeout
overlaps rank 0's restart (the two replicas play their halves independently until the rollout
ends).

Checked:
- every iteration's metrics line exists, with rollout_logprob_diff_max < 1e-4 (fp32): the
  servers held the trainer's weights every time, the first rollout included (so the real
  weights replaced the dummy ones), and every answer carried the pushed weight version, or the
  engine would have raised;
- nothing of the model's size was written: no weight file under <run>/sglang, whose non-log
  files total less than a tenth of one push;
- the weight version advanced once per TRAIN step, pushed in buckets of <= 100 KiB, each leader
  receiving exactly the tp half it lacks (the weight plan); every strike was followed by a
  start of that server, each of its starts on a port of its own;
- after the run every server process group is gone (not its port: a freed port is anyone's).
"""

from __future__ import annotations

import json
import math
import re

import pytest
from strikes import kill, stall, striking

from earl_megatron.config.train import TrainConfig
from earl_megatron.runtime import fault_points
from earl_megatron.testing.multiproc import run_distributed

pytestmark = pytest.mark.timeout(2400)  # server starts take minutes on 2 busy cores


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def test_trainer_on_sglang_servers_syncs_weights_and_survives_every_fault(sglang_python,
                                                                          run_dir, group_gone,
                                                                          monkeypatch):
    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.weight_plan import minimum_recv_bytes

    out = run_dir / "run"
    points = run_dir / "fault-points"
    points.mkdir()
    monkeypatch.setenv(fault_points.ENV, str(points))  # the ranks inherit it
    log_dir, log_dir1 = (str(out / "sglang" / f"logs-DP2-dp{r}") for r in (0, 1))
    plan = [("sglang.start", {"log_dir": log_dir}, kill),
            ("sglang.group", {"log_dir": log_dir}, kill),
            ("sglang.push", {"log_dir": log_dir}, kill),
            ("sglang.generate", {"log_dir": log_dir, "version": "it2"}, kill)]
    beside = [("sglang.generate", {"log_dir": log_dir1, "version": "it2"}, stall)]
    cfg = TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"engine": "sglang", "sglang_python": sglang_python, "sglang_device": "cpu",
                    "episodes_per_iteration": 4, "max_turns": 4,
                    "sglang_bucket_mb": 0.1},  # the ~0.8 MB model in buckets of <= 100 KiB
        "algorithm": {"micro_batch_size": 2},
        # the strikes cost what these bound: a dead peer in group setup waits out
        # weight_sync_timeout_s, the stall server_request_timeout_s: 30 s each, over 30x what
        # a turn (< 1 s) or a push (< 0.2 s) takes on an idle host
        "cluster": {"collective_timeout_s": 900, "server_start_timeout_s": 300,
                    "server_request_timeout_s": 30, "weight_sync_timeout_s": 30,
                    "server_max_restarts": 2},
        "run": {"iterations": 3, "output_dir": str(out), "checkpoint_every": 0,
                "eval_episodes": 2, "live_view": False},
    })
    with striking(points, plan, beside) as struck:
        histories = run_distributed(_train, 2, cfg, timeout=2100,
                                    collective_timeout_s=cfg.cluster.collective_timeout_s)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
             if x.strip()]
    lines = [x for x in lines if "iteration" in x]
    print(json.dumps([{k: x.get(k) for k in ("iteration", "rollout_logprob_diff_max",
                                             "rollout_weight_version", "rollout_push_s",
                                             "rollout_servers_died")} for x in lines], indent=1))
    assert [x["iteration"] for x in lines] == [0, 1, 2]
    assert len(histories[0]) == len(histories[1]) == 3
    for x in lines:
        assert x["rollout_engine"] == "sglang"
        assert x["rollout_logprob_diff_max"] < 1e-4, x
        assert x["layouts"]["rollout"] == "DP2" and len(x["rollout_servers"]) == 2
    # pushes: one before the start evaluation, then one after every TRAIN step
    assert [x["rollout_weight_version"] for x in lines] == ["it2", "it3", "it4"]
    half = minimum_recv_bytes(ModelConfig.tiny(vocab_size=32), ParallelLayout(tp=2), 0)
    for x in lines:  # bucketed pushes: several buckets, each within the cap but single tensors
        assert x["rollout_push_buckets"] > 3, x["rollout_push_buckets"]
        assert x["rollout_push_bucket_max_bytes"] <= 0.1 * 2**20
        # the weight plan: both ranks lead a server; each received the other's tp half, once
        # per push (a re-push after a restart comes from the leader's own copy)
        assert x["weight_sync_bytes_in_leader"] == half > 0 and x["weight_sync_bytes_in_max"] == 0
    # item 3: the servers started from a config; no copy of the model was written
    files = [p for p in (out / "sglang").rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    written = sum(p.stat().st_size for p in files if p.suffix != ".log")
    assert written < lines[0]["rollout_push_bytes"] / 10, (written, files)
    # every strike was followed by a start of that server, each on a port of its own
    logs = [(out / "sglang" / f"logs-DP2-dp{r}" / "server-0.log").read_text() for r in (0, 1)]
    pids = [[int(x) for x in re.findall(r"=== pid (\d+)", log)] for log in logs]
    for (_, _, pid), r in zip(struck, (0, 0, 0, 0, 1)):
        assert pid in pids[r] and pids[r].index(pid) < len(pids[r]) - 1, (struck, pids)
    ports = [re.findall(r"start: .* --port (\d+)", log) for log in logs]
    assert len(ports[0]) == len(pids[0]) >= 5 and len(ports[1]) == len(pids[1]) >= 2, ports
    assert all(len(set(p)) == len(p) for p in ports), ports
    reasons = [re.findall(r"=== restart after: (.*)", log) for log in logs]
    assert any(r.startswith("weight-update group setup") for r in reasons[0]), reasons
    assert any(r.startswith("weight push") for r in reasons[0]), reasons
    assert any("timed out" in r for r in reasons[1]), reasons  # the stall
    assert lines[-1]["rollout_servers_died"] >= 4
    for p in out.glob("sglang/logs-*/server-*.log"):  # every server of the run has exited
        for pid in map(int, re.findall(r"=== pid (\d+)", p.read_text())):
            assert group_gone(pid), (p, pid)


def test_asynchronous_ppo_on_sglang_servers(sglang_python, run_dir):
    """algorithm.max_staleness=1 with SGLang: each replica's leader holds the episodes in flight
    and plays them through its server; the others get the outcome by broadcast. The servers
    hold the trainer's weights for every token the current version sampled, episodes carry
    over (some trained tokens are a version old, none older), nothing is dropped. The run is
    PPO (issue #45): the critic lives beside the policy in the trainer's TRAIN layout (tp2),
    whatever engine rolls out, and scores every batch (value metrics finite, the value loss
    positive, the critic's steps recorded)."""
    out = run_dir / "async"
    cfg = TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": []},
        "rollout": {"engine": "sglang", "sglang_python": sglang_python, "sglang_device": "cpu",
                    "episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"name": "ppo", "gamma": 0.99, "lam": 0.95, "critic": {"lr": 1e-2},
                      "micro_batch_size": 2, "max_staleness": 1, "off_policy": "decoupled",
                      "old_logprobs": "recompute"},
        "cluster": {"collective_timeout_s": 900, "server_start_timeout_s": 300,
                    "server_request_timeout_s": 60, "weight_sync_timeout_s": 45,
                    "server_max_restarts": 2},
        "run": {"iterations": 4, "output_dir": str(out), "checkpoint_every": 0,
                "eval_episodes": 2, "live_view": False},
    })
    hist = run_distributed(_train, 2, cfg, timeout=2100,
                           collective_timeout_s=cfg.cluster.collective_timeout_s)[0]
    print(json.dumps([{k: h.get(k) for k in ("iteration", "pool_carried", "pool_admitted",
                                             "staleness_shares", "rollout_logprob_diff_max")}
                      for h in hist], indent=1))
    assert [h["iteration"] for h in hist] == [0, 1, 2, 3]
    assert hist[0]["pool_admitted"] == 8
    for h in hist:
        assert h["rollout_engine"] == "sglang" and h["pool_dropped"] == 0, h
        assert h["rollout_logprob_diff_max"] < 1e-4, h
        assert h["staleness_max"] <= 1, h
        assert h["critic_layout"] == "TP2" and h["value_loss"] > 0, h
        assert all(math.isfinite(h[k]) for k in ("value_loss", "explained_variance",
                                                 "value_mean", "return_mean")), h
        assert {"values", "critic_train"} <= set(h["seconds"]), h["seconds"]
    assert any(h["staleness_mean"] > 0 for h in hist[1:])
    # each server's KV pool is capped at the run's worst case: (k+1) x 4 episodes of the
    # context bound (config.train.sglang_kv_tokens), not 5% of the host's memory
    context = cfg.rollout.max_context_tokens or cfg.model.max_position_embeddings
    for log in out.glob("sglang/logs-*/server-*.log"):
        text = log.read_text()
        assert f"--max-total-tokens {8 * context} " in text, log
        pools = [int(x) for x in re.findall(r"KV Cache is allocated.*#tokens: (\d+)", text)]
        assert pools and all(p <= 8 * context for p in pools), (log, pools)
