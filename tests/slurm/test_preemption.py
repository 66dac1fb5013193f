"""Preemption on a real Slurm: SIGTERM to the batch shell (as ``--signal=B:TERM@300`` sends it
before the time limit) in the middle of an iteration longer than torchrun's default 30 s
shutdown timeout. The trainer abandons the iteration at its next safe point, checkpoints the last
completed one (no periodic checkpoint exists yet: checkpoint_every is the whole run), exits 0;
the job requeues itself (same job id), resumes and finishes COMPLETED; every iteration appears
exactly once and the metrics equal an uninterrupted run's, line for line."""

import subprocess
import time

import pytest
from slurm_helpers import SMALL, metrics, strip

# > 30 s per iteration even on an idle 2-core machine (19 s at 320 games and 1 epoch there, 40-60 s under
# load): 2 ranks (one per node) play 320 Connect Four games of up to 6 turns and train 3 epochs
SLOW = [o for o in SMALL if not o.startswith("rollout.max_turns=")] + [
    "layout=static", "layout.rollout=dp2", "layout.logprob=dp2", "layout.train=tp2",
    "rollout.episodes_per_iteration=320", "algorithm.epochs=3", "rollout.max_turns=6", "run.iterations=2",
    "run.checkpoint_every=2", "layout.memory_budget_gb=1"]


@pytest.mark.timeout(1500)  # three jobs of 2 iterations > 30 s each, and a requeue
def test_sigterm_mid_iteration_requeues_and_resumes_exactly_once(slurm, tmp_path):
    out = tmp_path / "preempted"
    job = slurm.submit(2, SLOW + [f"run.output_dir={out}"], tmp_path, EARL_NPROC_PER_NODE="1")
    deadline = time.time() + 400
    while time.time() < deadline and len(metrics(out)) < 1:
        assert slurm.show(job)["JobState"] in ("PENDING", "RUNNING"), slurm.log(job)[-3000:]
        time.sleep(1)
    assert len(metrics(out)) == 1, slurm.log(job)[-3000:]
    time.sleep(5)  # into iteration 1's rollout
    assert len(metrics(out)) == 1
    t_term = time.time()
    subprocess.run(["scancel", "--batch", "--signal=TERM", str(job)], check=True, timeout=30)
    # the first segment ends (requeued: PENDING again, Restarts=1); Slurm holds a requeued job
    # ~2 minutes (BeginTime): release it now instead of waiting
    while time.time() < deadline:
        info = slurm.show(job)
        if info.get("Restarts") == "1":
            break
        time.sleep(1)
    t_stopped = time.time()
    assert info.get("Restarts") == "1", (info, slurm.log(job)[-3000:])
    first_segment = slurm.log(job)
    # the TERM lands in iteration 1: its rollout is abandoned (stopped 0) or its begun train
    # stage is finished (stopped 1); either way the last completed iteration is saved by the stop
    import re
    done = re.search(r"trainer stopped (\d+)", first_segment)
    assert done and int(done.group(1)) in (0, 1), first_segment[-3000:]
    saved = out / "checkpoints" / f"iter_{int(done.group(1)):06d}" / "loop.json"
    assert saved.is_file() and "requeueing job" in first_segment
    # Release it only once it is PENDING and a second has passed: slurmd revokes the first
    # segment's credential with a one-second timestamp, and a new allocation in that same second
    # is refused ("Killing non-startable batch JobId: Job credential revoked", seen in CI)
    while time.time() < deadline and slurm.show(job)["JobState"] != "PENDING":
        time.sleep(0.5)
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True,
                   timeout=30)
    info = slurm.wait(job, 600)
    log = slurm.log(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert info["Restarts"] == "1"
    assert "restart 1:" in log and "resumed from" in log
    hist = metrics(out)
    assert [h["iteration"] for h in hist] == [0, 1]
    assert hist[0]["seconds"]["total"] > 30, hist[0]["seconds"]  # longer than torchrun's 30 s
    assert t_stopped - t_term < 300  # within --signal's lead time

    # the same run, never interrupted
    ref = tmp_path / "uninterrupted"
    job = slurm.submit(2, SLOW + [f"run.output_dir={ref}"], tmp_path, EARL_NPROC_PER_NODE="1")
    info = slurm.wait(job, 600)
    assert info["JobState"] == "COMPLETED", slurm.log(job)[-3000:]
    assert strip(hist) == strip(metrics(ref))
