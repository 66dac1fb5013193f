"""``earl train`` as a user runs it (a subprocess): bad input is one line and exit 2 under any
rank count, before any worker starts (a warm start on a game without a scripted expert
included); a worker killed mid-run ends the run with one line on stderr naming the rank, how it
ended and its log file (torchrun's failure box and the other ranks' errors stay in the logs); a
worker that raises is named by its own exception line, not by Hydra's hint.

Where the kill lands is decided by construction, as in test_stop.py: the run plays
``held_connect_four``, whose steps hold from iteration 1's rollout on (once metrics.jsonl has
iteration 0's line) until the process is told to stop, so rank 1 is killed mid-iteration on any
machine speed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

RUN = ["model.vocab_size=32", "layout=static", "layout.rollout=dp2", "layout.logprob=dp2",
       "layout.train=dp2", "env.eval_opponents=[random]", "rollout.episodes_per_iteration=8",
       "rollout.max_turns=6", "algorithm.micro_batch_size=2", "run.iterations=3",
       "run.checkpoint_every=0", "run.eval_episodes=2", "run.eval_every=0",
       "run.live_view=false"]
HELD = "earl_megatron.testing.envs:held_connect_four"


def _earl(*args, **kw):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("EARL_STOP_FILE", None)
    return subprocess.Popen([sys.executable, "-m", "earl_megatron.cli", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_bad_input_is_one_line_and_exit_2_under_any_rank_count(nproc, tmp_path):
    proc = _earl("--nproc-per-node", str(nproc), "algorithm.lr=nan",
                 f"run.output_dir={tmp_path / 'run'}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert (out + err).splitlines() == ["configuration error: algorithm.lr=nan must be a finite "
                                        "number"]
    assert not (tmp_path / "run").exists()   # nothing started, nothing written


def test_a_warm_start_without_expert_stops_before_any_rank(tmp_path):
    # the default recipe (Connect Four: no scripted expert), exactly as a new user types it
    proc = _earl("--nproc-per-node", "2", "sft.steps=4", cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert (out + err).splitlines() == [
        "configuration error: sft.steps=4 with sft.data=null plays the environment's expert, "
        "but connect_four has no scripted expert; give the warm start a JSONL file of chat "
        "trajectories (sft.data=PATH, docs/trainer.md) or set sft.steps=0"]
    assert list(tmp_path.iterdir()) == []   # no runs/cpu_demo/logs: no rank started


def test_a_failing_worker_is_named_by_its_own_error(tmp_path):
    # passes the pre-launch check, then fails inside the ranks: the held environment's hold
    # outlasts its 1 s limit in iteration 1 (nobody tells it to stop) and raises HoldTimeout
    out = tmp_path / "run"
    proc = _earl("--nproc-per-node", "2", f"run.output_dir={out}", *RUN, f"env.name={HELD}",
                 f"+env.kwargs.hold_when={out / 'metrics.jsonl'}", "+env.kwargs.hold_limit_s=1")
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    m = re.fullmatch(r"earl train: rank [01] \(pid \d+\) exited with status 1: "
                     r"earl_megatron\.testing\.envs\.HoldTimeout: held_connect_four: "
                     rf"{re.escape(str(out))}/metrics\.jsonl has 1 line\(s\) but this process "
                     r"was not told to stop within 1 s .*; log (\S+)", lines[0])
    assert m, lines[0]
    assert "HYDRA_FULL_ERROR" in Path(m[1]).read_text()   # the hint is there, and skipped


def test_a_killed_worker_is_one_summary_line_naming_its_log(tmp_path):
    out = tmp_path / "run"
    proc = _earl("--nproc-per-node", "2", "--shutdown-timeout", "10", f"run.output_dir={out}",
                 *RUN, f"env.name={HELD}", f"+env.kwargs.hold_when={out / 'metrics.jsonl'}")
    try:
        deadline = time.monotonic() + 400
        while not (out / "metrics.jsonl").exists() or \
                not (out / "metrics.jsonl").read_text().endswith("\n"):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no metrics line for iteration 0 within 400 s"
            time.sleep(0.1)
        assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["iteration"] == 0
        workers = {int(p.environ().get("LOCAL_RANK", -1)): p
                   for p in psutil.Process(proc.pid).children(recursive=True)
                   if "LOCAL_RANK" in p.environ()}
        victim = workers[1]
        victim.send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    m = re.fullmatch(rf"earl train: rank 1 \(pid {victim.pid}\) was killed by SIGKILL.*; "
                     r"log (\S+)", lines[0])
    assert m, lines[0]
    log = Path(m[1])
    assert log.is_file() and log.name == "stderr.log" and log.parent.name == "1"
    assert log.is_relative_to(out / "logs")
    assert "iter" in stdout   # rank 0's progress lines stayed on the console
