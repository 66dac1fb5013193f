"""Stopping at a safe point without Slurm: SIGTERM to torchrun (which forwards it to its workers,
as Slurm's step signal does), mid-run, with no periodic checkpoint yet. The workers stop at the
next safe point, checkpoint the last completed iteration, skip evaluation, exit 0, and say so in
the run's stop file (``<run>/stop``); the rerun resumes there and its metrics equal an
uninterrupted run's.

Where the stop lands is decided by construction, not by timing: the run plays
``earl_megatron.testing.envs:held_connect_four``, whose steps hold from iteration 1's rollout on
(once metrics.jsonl has iteration 0's line) until the process is told to stop. So iteration 0
completes, iteration 1 cannot complete before the signal, and the files must say "stopped 0" on
an idle machine and a loaded one alike. The rerun and the reference run play the plain
``connect_four`` (the same games)."""

import json
import os
import signal
import subprocess
import sys
import time

from earl_megatron.config.train import TrainConfig
from earl_megatron.testing.multiproc import run_distributed

RUN = ["model.vocab_size=32", "layout=static", "layout.rollout=dp2", "layout.logprob=dp2",
       "layout.train=tp2", "env.eval_opponents=[random]", "rollout.episodes_per_iteration=8",
       "rollout.max_turns=6", "algorithm.micro_batch_size=2", "run.iterations=3",
       "run.checkpoint_every=3", "run.eval_episodes=2", "run.eval_every=0",
       "run.live_view=false"]
HELD = "earl_megatron.testing.envs:held_connect_four"


def _held(out):
    return [f"env.name={HELD}", f"+env.kwargs.hold_when={out / 'metrics.jsonl'}"]


def _launch(out, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("EARL_STOP_FILE", None)   # the default: <run>/stop
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "--shutdown-timeout", "120",
                             "-m", "earl_megatron.train", f"run.output_dir={out}", *RUN,
                             *overrides],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for(what, predicate, proc, timeout):
    """Poll ``predicate`` until true; fail at once if ``proc`` ended, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n"
                                 f"{proc.stdout.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.1)


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _metrics(out):
    """The complete lines of metrics.jsonl ([] before it exists; a line being written waits)."""
    try:
        text = (out / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(l) for l in text.splitlines(keepends=True) if l.endswith("\n")]


def test_sigterm_to_torchrun_stops_at_a_safe_point_and_resumes(tmp_path):
    out = tmp_path / "run"
    stop = out / "stop"
    proc = _launch(out, *_held(out))
    # the event: iteration 0 recorded; from here on the rollout holds until the signal
    _wait_for("metrics line for iteration 0", lambda: len(_metrics(out)) >= 1, proc, 400)
    assert not stop.exists()
    os.kill(proc.pid, signal.SIGTERM)  # torchrun: forwards TERM to its workers
    log = proc.communicate(timeout=300)[0].decode()
    # torchrun itself exits non-zero after a forwarded signal; the workers' word is the file
    assert stop.read_text() == "stopped 0\n", log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000000"
    assert "stopped at a safe point after iteration 0" in log
    assert "evaluation end" not in log  # skipped once stopping
    assert [h["iteration"] for h in _metrics(out)] == [0]

    # rerun: a 'stopped' file is an answer, not a request; it does not stop the rerun
    proc = _launch(out)
    log = proc.communicate(timeout=400)[0].decode()
    assert proc.returncode == 0, log[-3000:]
    assert "resumed from" in log, log[-3000:]
    assert stop.read_text() == "stopped 0\n"  # a run that was not told to stop writes nothing
    resumed = _metrics(out)
    resolved = json.loads((out / "resolved.json").read_text())
    assert resolved["env"]["name"] == "connect_four"
    resolved["run"]["output_dir"] = str(tmp_path / "full")
    full = run_distributed(_train, 2, TrainConfig.from_dict(resolved), timeout=400)[0]
    strip = lambda hs: [{k: v for k, v in h.items() if k != "seconds"} for h in hs]  # noqa: E731
    assert [h["iteration"] for h in resumed] == [0, 1, 2]
    assert strip(resumed) == strip(full)
    evals = json.loads((out / "eval.json").read_text())
    assert set(evals) == {"start", "end"}


def test_requested_in_the_run_stop_file_stops_the_run(tmp_path):
    """The stop file's default place is the run directory (no EARL_STOP_FILE): ``requested``
    written there (as the sbatch trap does) stops the run; the held rollout makes the request
    land in iteration 1 whatever the machine's speed."""
    out = tmp_path / "run"
    stop = out / "stop"
    proc = _launch(out, *_held(out))
    _wait_for("metrics line for iteration 0", lambda: len(_metrics(out)) >= 1, proc, 400)
    stop.write_text("requested\n")
    log = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, log[-3000:]   # torchrun was never signalled
    assert stop.read_text() == "stopped 0\n", log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000000"
    assert [h["iteration"] for h in _metrics(out)] == [0]
    assert not (tmp_path / "stop").exists() and not (out / "stop.tmp").exists()
