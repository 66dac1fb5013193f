"""End to end: the demo workload under a memory budget, auto layouts vs each static layout.

Runs the real trainer (``torchrun -m earl_megatron.train``, the CPU demo recipe) once per
variant, one after another, with the same seed, iterations and per-rank memory budget:

- auto      the selector picks each stage's layout at its boundary;
- static    one fixed (rollout, train) layout pair per run.

A static layout whose predicted memory exceeds the budget stops the run with
LayoutOverBudgetError (what a GPU run would hit as an out-of-memory crash, here found before
the stage runs; the memory model is exact against the live tensors on CPU, see docs/selector.md);
the table shows at which iteration. Time is the sum of the iterations' stage times (rollout,
switches, train; start-up and evaluation excluded) from each run's metrics.jsonl, and the wall
time of the whole run beside it.

Prints, from one run of this script (the machine is noisy; compare within one run):
  variant, finished iterations / asked, failure, loop seconds, wall seconds, CPU seconds of
  all ranks (other jobs inflate wall time much more than CPU time), layouts used
  auto / best surviving static (target <= 1.10), and whether some static layout failed where
  auto finished.

Run:  python benchmarks/e2e.py [--iterations 12] [--budget-gb 0.25] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(ROOT))

# (rollout, train); logprob follows train (no reference model in the demo recipe)
STATIC = [("dp4", "dp4"), ("dp4", "cp2-dp2"), ("tp2-dp2", "dp4"), ("tp2-dp2", "cp2-dp2"),
          ("tp2-dp2", "cp4"), ("tp2-dp2", "tp2-dp2"), ("tp2-dp2", "pp2-dp2"), ("tp4", "cp4")]


def _children_cpu() -> float:
    """CPU seconds of finished child processes (torchrun and its ranks): less sensitive than
    wall time to other jobs on a shared machine."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_variant(name: str, overrides: list[str], out: Path, timeout: float) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "-m", "earl_megatron.train", f"run.output_dir={out}", "run.resume=false",
           *overrides]
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    hist = []
    if (out / "metrics.jsonl").exists():
        hist = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    failure = ""
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        for marker in ("layout error: ", "LayoutOverBudgetError: ", "NoLayoutFitsError: ",
                       "configuration error", "Error: "):
            i = text.find(marker)
            if i >= 0:
                failure = text[i:i + 200].splitlines()[0]
                break
        failure = failure or f"exit code {proc.returncode}"
    used = {stage: Counter(h["layouts"][stage] for h in hist) for stage in ("rollout", "train")}
    return {"name": name, "iterations": len(hist), "failure": failure, "wall_s": wall,
            "cpu_s": cpu,
            "loop_s": sum(h["seconds"]["total"] for h in hist),
            "layouts": {k: dict(v) for k, v in used.items()},
            "win_rate_last": hist[-1]["win_rate"] if hist else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--budget-gb", type=float, default=0.25)
    ap.add_argument("--variants", nargs="*", default=None,
                    help="auto and/or rollout:train pairs, e.g. auto dp4:dp4 dp4:cp4")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("overrides", nargs="*", default=[], help="extra Hydra overrides for all runs")
    args = ap.parse_args()
    pairs = STATIC if args.variants is None else [
        tuple(v.split(":")) for v in args.variants if v != "auto"]
    names = (["auto"] if args.variants is None or "auto" in args.variants else []) + \
        [f"{r}:{t}" for r, t in pairs]
    common = [f"run.iterations={args.iterations}", f"layout.memory_budget_gb={args.budget_gb}",
              "run.eval_episodes=4", "env.eval_opponents=[random]", "run.checkpoint_every=0",
              "run.live_view=false", *args.overrides]
    tmp = Path(tempfile.mkdtemp(prefix="earl-e2e-"))
    results = []
    try:
        for name in names:
            if name == "auto":
                extra = ["layout=auto"]
            else:
                r, t = name.split(":")
                extra = ["layout=static", f"layout.rollout={r}", f"layout.train={t}",
                         f"layout.logprob={t}"]
            res = run_variant(name, common + extra, tmp / name.replace(":", "_"), args.timeout)
            results.append(res)
            print(json.dumps(res), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nE2E: {args.iterations} iterations, {args.budget_gb} GB per rank, 4 CPU ranks")
    print(f"{'variant':18s} {'done':>7s}  {'loop s':>8s} {'wall s':>8s} {'cpu s':>8s}  "
          "failure / layouts used")
    for r in results:
        done = f"{r['iterations']}/{args.iterations}"
        what = r["failure"] or "; ".join(f"{k} " + ",".join(f"{lay}x{n}" for lay, n in v.items())
                                         for k, v in r["layouts"].items())
        print(f"{r['name']:18s} {done:>7s}  {r['loop_s']:8.1f} {r['wall_s']:8.1f} "
              f"{r['cpu_s']:8.1f}  {what}")
    auto = next((r for r in results if r["name"] == "auto"), None)
    survivors = [r for r in results if r["name"] != "auto" and not r["failure"]
                 and r["iterations"] == args.iterations]
    failed = [r["name"] for r in results if r["name"] != "auto" and r["failure"]]
    if auto is not None:
        ok = not auto["failure"] and auto["iterations"] == args.iterations
        print(f"\nauto finished: {ok}; static layouts that failed: {', '.join(failed) or 'none'}")
        if survivors:
            best = min(survivors, key=lambda r: r["loop_s"])
            print(f"auto / best surviving static ({best['name']}): loop time "
                  f"{auto['loop_s'] / best['loop_s']:.2f}x, wall time "
                  f"{auto['wall_s'] / best['wall_s']:.2f}x, CPU time "
                  f"{auto['cpu_s'] / best['cpu_s']:.2f}x (target <= 1.10)")


if __name__ == "__main__":
    main()
