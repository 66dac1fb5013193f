"""Preemption on a real Slurm: SIGTERM to the batch shell (as ``--signal=B:TERM@300`` sends it
before the time limit) in the middle of an iteration, with a stop that takes longer than
torchrun's default 30 s shutdown timeout. The trainer abandons the iteration at its next safe
point, checkpoints the last completed one (no periodic checkpoint exists yet: checkpoint_every is
the whole run), exits 0; the job requeues itself (same job id), resumes and finishes COMPLETED
0:0; every iteration appears exactly once and the metrics equal an uninterrupted run's, line for
line.

Both "mid-iteration" and "a long stop" hold by construction, not by the machine's speed: the job
plays ``earl_megatron.testing.envs:held_connect_four``, whose steps hold from iteration 1's
rollout on (once metrics.jsonl has iteration 0's line) until the trainer is told to stop, then
35 s more before the turn ends. The test sends TERM once a step has begun to hold (the env's
``holding_file``), not once the metrics line exists: between that line and the rollout the
trainer looks for a stop at the stage boundary too, and a TERM landing there stops it at once
(seen once in CI, a 10 s stop). So the TERM always lands inside iteration 1's rollout, the files
say "stopped 0", and the stop outlasts 30 s on an idle host and a loaded one. The test writes the
``release`` file once the first segment stopped: the requeued segment plays through."""

import re
import subprocess
import time

import pytest
from slurm_helpers import SMALL, metrics, query, strip

HOLD_AFTER_STOP_S = 35   # > torchrun's default --shutdown-timeout (30 s)
RUN = SMALL + ["layout=static", "layout.rollout=dp2", "layout.logprob=dp2", "layout.train=tp2",
               "rollout.episodes_per_iteration=8", "run.iterations=2", "run.checkpoint_every=2"]


def _held(out, release, holding):
    return ["env.name=earl_megatron.testing.envs:held_connect_four",
            f"+env.kwargs.hold_when={out / 'metrics.jsonl'}",
            f"+env.kwargs.hold_after_stop_s={HOLD_AFTER_STOP_S}",
            f"+env.kwargs.release_when={release}",
            f"+env.kwargs.holding_file={holding}"]


def _until(what, predicate, deadline, log):
    while not predicate():
        assert time.monotonic() < deadline, f"no {what}:\n{log()[-3000:]}"
        time.sleep(0.5)


@pytest.mark.timeout(1500)  # three short jobs, a 35 s stop and a requeue, on a loaded host
def test_sigterm_mid_iteration_requeues_and_resumes_exactly_once(slurm, tmp_path):
    out, release, holding = tmp_path / "preempted", tmp_path / "release", tmp_path / "holding"
    job = slurm.submit(2, RUN + _held(out, release, holding) + [f"run.output_dir={out}"], tmp_path,
                       EARL_NPROC_PER_NODE="1")
    deadline = time.monotonic() + 900
    log = lambda: slurm.log(job)  # noqa: E731

    def running_and_holding():
        assert slurm.show(job)["JobState"] in ("PENDING", "RUNNING"), log()[-3000:]
        return holding.exists()
    # the event: iteration 0 recorded and iteration 1's rollout holding until told to stop
    _until("held step in iteration 1", running_and_holding, deadline, log)
    assert len(metrics(out)) == 1
    t_term = time.monotonic()
    # not retried: a second TERM would be a second stop request; above MessageTimeout=60
    subprocess.run(["scancel", "--batch", "--signal=TERM", str(job)], check=True, timeout=90)
    # the first segment ends requeued (PENDING again, Restarts=1)
    _until("requeue", lambda: slurm.show(job).get("Restarts") == "1", deadline, log)
    t_stopped = time.monotonic()
    first_segment = log()
    assert re.search(r"trainer stopped 0\b", first_segment), first_segment[-3000:]
    assert "requeueing job" in first_segment
    # the batch shell asked through the run's own stop file, not one in the submit directory
    assert f"asking the trainer to checkpoint and stop ({out / 'stop'})" in first_segment
    assert (out / "checkpoints" / "iter_000000" / "loop.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000000"
    assert [h["iteration"] for h in metrics(out)] == [0]   # iteration 1 was abandoned whole
    # by construction the stop took the held turn's 35 s: longer than torchrun's 30 s shutdown
    # timeout, and still clean (the batch shell's TERM never reached torchrun)
    assert t_stopped - t_term >= HOLD_AFTER_STOP_S
    release.write_text("the stop landed; the requeued segment plays through\n")
    # Release it only once it is PENDING and a second has passed: slurmd revokes the first
    # segment's credential with a one-second timestamp, and a new allocation in that same second
    # is refused ("Killing non-startable batch JobId: Job credential revoked", seen in CI)
    _until("PENDING", lambda: slurm.show(job)["JobState"] == "PENDING", deadline, log)
    time.sleep(2.0)
    # Slurm holds a requeued job ~2 minutes (BeginTime): release it now instead of waiting
    done = query(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    assert done.returncode == 0, done.stderr
    info = slurm.wait(job, 600)
    full_log = log()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", full_log[-3000:]
    assert info["Restarts"] == "1"
    assert "restart 1:" in full_log and "resumed from" in full_log
    hist = metrics(out)
    assert [h["iteration"] for h in hist] == [0, 1]
    assert not (out / "stop").exists()   # the batch script consumed the trainer's answer

    # the same run, never interrupted, on the plain game (the held one plays the same moves)
    ref = tmp_path / "uninterrupted"
    job = slurm.submit(2, RUN + [f"run.output_dir={ref}"], tmp_path, EARL_NPROC_PER_NODE="1")
    info = slurm.wait(job, 600)
    assert info["JobState"] == "COMPLETED", slurm.log(job)[-3000:]
    assert strip(hist) == strip(metrics(ref))
