"""Stopping at a safe point without Slurm: SIGTERM to torchrun (which forwards it to its workers,
as Slurm's step signal does), mid-run, with no periodic checkpoint yet. The workers stop at the
next safe point, checkpoint the last completed iteration, skip evaluation, exit 0, and say so in
the stop file; the rerun resumes there and its metrics equal an uninterrupted run's."""

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


def _launch(out, stop_file):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", EARL_STOP_FILE=str(stop_file))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "--shutdown-timeout", "120",
                             "-m", "earl_megatron.train", f"run.output_dir={out}", *RUN],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _metrics(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_to_torchrun_stops_at_a_safe_point_and_resumes(tmp_path):
    out, stop = tmp_path / "run", tmp_path / "stop"
    proc = _launch(out, stop)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and _metrics(out):
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)  # torchrun: forwards TERM to its workers
    log = proc.communicate(timeout=300)[0].decode()
    # torchrun itself exits non-zero after a forwarded signal; the workers' word is the file
    assert stop.read_text().startswith("stopped "), log[-3000:]
    done = int(stop.read_text().split()[1])
    assert done in (0, 1), log[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"iter_{done:06d}"
    assert f"stopped at a safe point after iteration {done}" in log
    assert "evaluation end" not in log  # skipped once stopping
    assert [h["iteration"] for h in _metrics(out)] == list(range(done + 1))

    stop.unlink()
    proc = _launch(out, stop)
    log = proc.communicate(timeout=400)[0].decode()
    assert proc.returncode == 0, log[-3000:]
    assert not stop.exists()  # a run that was not told to stop leaves no stop file
    resumed = _metrics(out)
    resolved = json.loads((out / "resolved.json").read_text())
    resolved["run"]["output_dir"] = str(tmp_path / "full")
    full = run_distributed(_train, 2, TrainConfig.from_dict(resolved), timeout=400)[0]
    strip = lambda hs: [{k: v for k, v in h.items() if k != "seconds"} for h in hs]  # noqa: E731
    assert [h["iteration"] for h in resumed] == [0, 1, 2]
    assert strip(resumed) == strip(full)
    evals = json.loads((out / "eval.json").read_text())
    assert set(evals) == {"start", "end"}
