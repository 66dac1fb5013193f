"""Helpers for tests on a real Slurm (``make test-slurm`` starts one: tools/slurm_local.sh).

Jobs are submitted as the README says: ``sbatch ... recipes/slurm/train.sbatch <overrides>``
from the repo root (the job finds the repo as SLURM_SUBMIT_DIR), with EARL_NPROC_PER_NODE for
this CPU partition and EARL_PYTHON for the test's interpreter. A test that finds no Slurm
(SLURM_CONF unset or slurmctld not answering) is skipped with the command that provides one.

Queries (``scontrol show``, ``scontrol update``, ``scancel`` of a whole job: each safe to repeat)
go through ``query``, which retries a transient failure of the controller ("Socket timed out",
"Unable to contact slurm controller", no answer within the command's timeout) up to
``QUERY_TRIES`` times, ``QUERY_PAUSE_S`` apart, and then fails naming the command and Slurm's
words: on a loaded host (load average 50) slurmctld can miss a single call, which is not what a
test checks. ``sbatch`` is not retried (a timed-out submission may have queued the job).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "recipes" / "slurm" / "train.sbatch"

# a small run: tiny model, Connect Four, few short episodes (seconds per iteration)
SMALL = ["model.vocab_size=32", "env.eval_opponents=[random]", "rollout.max_turns=4",
         "algorithm.micro_batch_size=2", "run.eval_episodes=2", "run.eval_every=0",
         "run.live_view=false", "run.checkpoint_every=1"]


QUERY_TRIES = 5
QUERY_PAUSE_S = 5.0
QUERY_TIMEOUT_S = 90.0
"""Above slurm.conf's MessageTimeout=60 (tools/slurm_local.sh): Slurm gives up first and says
why."""
TRANSIENT = ("Socket timed out", "Unable to contact slurm controller",
             "Connection refused", "Connection timed out", "Resource temporarily unavailable")
"""Slurm's words for a controller that did not answer this time (it is up: slurm_up passed)."""


def query(cmd: list[str], *, tries: int = QUERY_TRIES, pause_s: float = QUERY_PAUSE_S,
          timeout_s: float = QUERY_TIMEOUT_S, run=subprocess.run
          ) -> subprocess.CompletedProcess:
    """``cmd`` (a Slurm query safe to repeat) until it answers; a transient failure (module doc)
    is retried, any other non-zero exit is returned as it is for the caller to assert on.
    RuntimeError after ``tries`` transient failures, naming the command and the last words."""
    last = ""
    for attempt in range(tries):
        if attempt:
            time.sleep(pause_s)
        try:
            out = run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            last = f"no answer within {timeout_s:g} s"
            continue
        if out.returncode == 0 or not any(t in out.stderr for t in TRANSIENT):
            return out
        last = out.stderr.strip()
    raise RuntimeError(f"{' '.join(cmd)}: the Slurm controller did not answer in {tries} tries "
                       f"{pause_s:g} s apart (last: {last})")


def slurm_up() -> bool:
    if not os.environ.get("SLURM_CONF"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True,
                              timeout=QUERY_TIMEOUT_S).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Slurm:
    def env(self, **extra: str) -> dict:
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        env.setdefault("EARL_PYTHON", sys.executable)
        # the worktree under test, even when the interpreter's editable install points elsewhere
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update(extra)
        return env

    def submit(self, nodes: int, overrides: list[str], logs: Path, *, sbatch_args=(),
               **env: str) -> int:
        """sbatch from the repo root; the job's log goes to ``logs/earl-<job>.out``."""
        self.logs = Path(logs)
        out = subprocess.run(
            ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={logs}/earl-%j.out",
             *sbatch_args, str(SBATCH), *overrides],
            cwd=REPO, env=self.env(**env), capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().split(";")[0])

    def show(self, job: int) -> dict[str, str]:
        out = query(["scontrol", "-o", "show", "job", str(job)])
        assert out.returncode == 0, f"scontrol show job {job}: {out.stderr.strip()}"
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait(self, job: int, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED",
                                                     "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
             ) -> dict[str, str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.show(job)
            if info.get("JobState") in states:
                return info
            time.sleep(2)
        query(["scancel", str(job)])
        raise TimeoutError(f"job {job} still {self.show(job).get('JobState')} after {timeout} s:"
                           f"\n{self.log(job)[-3000:]}")

    def log(self, job: int) -> str:
        f = self.logs / f"earl-{job}.out"
        return f.read_text() if f.exists() else ""


def metrics(out_dir: Path) -> list[dict]:
    f = Path(out_dir) / "metrics.jsonl"
    return [json.loads(l) for l in f.read_text().splitlines()] if f.exists() else []


def strip(history: list[dict]) -> list[dict]:
    """Records without wall-clock fields (equal across runs of the same seeds)."""
    return [{k: v for k, v in h.items() if k != "seconds"} for h in history]
