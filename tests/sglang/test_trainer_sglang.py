"""The trainer with rollout.engine=sglang on real CPU servers (opt-in: EARL_SGLANG_VENV).

One 2-rank run of 3 iterations, rollout layout dp2 (two tp1 servers), train layout tp2. While it
runs, the test SIGKILLs server 0 (by the pid its log names) as soon as iteration 0's metrics line
exists, i.e. during iteration 1's rollout. Checked:
- every iteration's metrics line exists, with rollout_engine "sglang" and
  rollout_logprob_diff_max < 1e-4 (fp32): the servers held the trainer's weights every time
  (every answer also carried the pushed weight version, or the engine would have raised);
- the weight version advanced once per TRAIN step, pushed in buckets of <= 100 KiB; the killed server was restarted once (a start
  after the killed pid in its log) and the iteration still has all its episodes;
- after the run every server's port is free again (stopped by process group on close).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed

pytestmark = pytest.mark.timeout(1800)  # server starts take minutes on 2 busy cores


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _kill_first_server_after_first_line(out: Path, done: threading.Event, killed: list):
    metrics, log = out / "metrics.jsonl", out / "sglang" / "logs-DP2-dp0" / "server-0.log"
    while not done.is_set():
        if metrics.is_file() and '"iteration"' in metrics.read_text() and log.is_file():
            pid = int(re.findall(r"=== pid (\d+)", log.read_text())[-1])
            os.killpg(pid, signal.SIGKILL)  # the process group this run started
            killed.append(pid)
            return
        time.sleep(0.2)


def test_trainer_on_sglang_servers_syncs_weights_and_survives_a_killed_server(sglang_python,
                                                                              run_dir,
                                                                              group_gone):
    from earl_megatron.rollout.sglang_server import _port_free

    out = run_dir / "run"
    cfg = TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "tp2"},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"engine": "sglang", "sglang_python": sglang_python, "sglang_device": "cpu",
                    "episodes_per_iteration": 4, "max_turns": 4,
                    "sglang_bucket_mb": 0.1},  # the ~0.8 MB model in buckets of <= 100 KiB
        "algorithm": {"micro_batch_size": 2},
        "run": {"iterations": 3, "output_dir": str(out), "checkpoint_every": 0,
                "eval_episodes": 2, "live_view": False},
    })
    done, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_first_server_after_first_line,
                               args=(out, done, killed), daemon=True)
    watcher.start()
    try:
        # collectives wait while a leader restarts its server: a long gloo timeout
        histories = run_distributed(_train, 2, cfg, timeout=1500, collective_timeout_s=900)
    finally:
        done.set()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
             if x.strip()]
    lines = [x for x in lines if "iteration" in x]
    print(json.dumps([{k: x.get(k) for k in ("iteration", "rollout_logprob_diff",
                                             "rollout_logprob_diff_max",
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
    for x in lines:  # bucketed pushes: several buckets, each within the cap but single tensors
        assert x["rollout_push_buckets"] > 3, x["rollout_push_buckets"]
        assert x["rollout_push_bucket_max_bytes"] <= 0.1 * 2**20
    assert killed, "the watcher never killed a server"
    log0 = (out / "sglang" / "logs-DP2-dp0" / "server-0.log").read_text()
    # a first start may itself be retried on a busy host (SGLangEngine._first_start), so the
    # log can hold more than two starts: what matters is a start after the killed process
    pids0 = [int(x) for x in re.findall(r"=== pid (\d+)", log0)]
    assert killed[0] in pids0 and pids0.index(killed[0]) < len(pids0) - 1, (killed, pids0)
    assert "=== restart after" in log0
    assert lines[-1]["rollout_servers_died"] >= 1
    ports = [int(e.split()[0].split(":")[1]) for e in lines[-1]["rollout_servers"]]
    assert all(_port_free("127.0.0.1", p) for p in ports)
    for p in out.glob("sglang/logs-*/server-*.log"):  # every server of the run has exited
        for pid in map(int, re.findall(r"=== pid (\d+)", p.read_text())):
            assert group_gone(pid), (p, pid)
