"""SIGTERM to a trainer that rolls out on SGLang (opt-in: EARL_SGLANG_VENV).

torchrun with 2 ranks, rollout DP2 (two real tp1 CPU servers), train TP2, checkpoints only at
the end (none periodic). The environment is earl_megatron.testing.envs:held_connect_four: once
iteration 0's metrics line exists, every step of iteration 1's rollout holds until its process
was told to stop, so the stop lands in that rollout on any machine speed. Then torchrun gets
SIGTERM (it forwards it to its workers, as Slurm's step signal does). Checked: the workers stop
at the next safe point (the SGLang rollout finishes its held episodes first: a stop is honoured
at the stage boundary), checkpoint iteration 0 (the one the stop file names), skip the
evaluation, and every server process group of the run has exited (the trainer stops them on
the way out).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(1800)  # two server starts take minutes on 2 busy cores


def test_sigterm_during_an_sglang_rollout_checkpoints_what_was_trained(sglang_python, run_dir,
                                                                       group_gone):
    out, stop = run_dir / "run", run_dir / "stop"
    metrics = out / "metrics.jsonl"
    run = ["model.vocab_size=32", "layout=static", "layout.rollout=dp2", "layout.logprob=dp2",
           "layout.train=tp2", "env.eval_opponents=[random]",
           "env.name=earl_megatron.testing.envs:held_connect_four",
           f"+env.kwargs.hold_when={metrics}",
           "rollout=sglang", "rollout.sglang_device=cpu", f"rollout.sglang_python={sglang_python}",
           "rollout.episodes_per_iteration=8", "rollout.max_turns=6",
           "rollout.max_action_tokens=4", "algorithm.micro_batch_size=2", "run.iterations=4",
           "run.checkpoint_every=4", "run.eval_episodes=2", "run.eval_every=0",
           "run.live_view=false", f"run.output_dir={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", EARL_STOP_FILE=str(stop))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "--shutdown-timeout", "240",
                             "-m", "earl_megatron.train", *run],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.time() + 1200
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and '"iteration"' in metrics.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        # the event: iteration 0 recorded; iteration 1's rollout now holds until the signal
        os.kill(proc.pid, signal.SIGTERM)  # torchrun: forwards TERM to its workers
        log = proc.communicate(timeout=600)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert stop.read_text().startswith("stopped "), log[-3000:]
    done = int(stop.read_text().split()[1])
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if '"iteration"' in x]
    assert done == 0 and [x["iteration"] for x in lines] == [0], log[-3000:]
    assert all(x["rollout_engine"] == "sglang" for x in lines)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"iter_{done:06d}"
    assert f"stopped at a safe point after iteration {done}" in log
    assert "evaluation end" not in log
    logs = list(out.glob("sglang/logs-*/server-*.log"))
    assert len(logs) == 2, logs
    for p in logs:  # every server of the run has exited, its whole process group
        pids = [int(x) for x in re.findall(r"=== pid (\d+)", p.read_text())]
        assert pids, p
        for pid in pids:
            assert group_gone(pid), (p, pid)
