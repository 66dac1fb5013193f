"""Benchmark: the algorithm menu's learning table (issue 44; docs/algorithms.md).

Every recipe of recipes/algorithm/ trains on two workloads, each a real
``torchrun -m earl_megatron.train`` on ``--nproc`` CPU ranks with ``layout=auto`` (ppo's critic
moving with the policy's TRAIN layout):

- **Connect Four** (the main job's recipe, recipes/config.yaml: tiny Llama against a
  uniform-random opponent, 64 episodes per iteration) for ``--c4-iterations`` iterations; the
  number is the end evaluation's sampled win rate against random (``--eval-episodes`` held-out
  games).
- **The calculator** (recipes/tool_use.yaml: the tool tokenizer, 64 episodes per iteration,
  reward 1 for the right answer) for ``--calc-iterations`` iterations, every recipe starting
  from ONE supervised warm start (the recipe's 1,200 steps, run once and shared through
  ``run.init``, on ``--warm-nproc`` ranks: a tiny model from scratch has no reward to learn
  from); the number is the end
  evaluation's sampled accuracy (mean reward) on ``--calc-eval-episodes`` held-out questions.

Each (recipe, workload) runs with each ``--seeds`` value as ``run.seed``; the table prints the
end numbers of every seed and the wall time of each run (the runs share one machine one after
another, so wall times compare within this run only). Prints one row per recipe:

    recipe     connect four: win rate (s0, s1)  wall s   calculator: accuracy (s0, s1)  wall s

    python benchmarks/algorithms.py [--recipes grpo,dapo] [--seeds 0 1] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # `python benchmarks/NAME.py`: this checkout's earl_megatron

RECIPES = sorted(p.stem for p in (ROOT / "recipes" / "algorithm").glob("*.yaml"))
def train(args, out: Path, overrides: list[str], config: str = "config",
          eval_episodes: int = 64, nproc: int = 0) -> float:
    """One fresh run (``run.resume=false`` refuses a folder holding an earlier one); seconds.
    A finished run of the same command in ``out`` (its bench.json) is reused, not rerun, so an
    interrupted table continues where it stopped."""
    nproc = nproc or args.nproc
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
           f"--nproc-per-node={nproc}", "-m", "earl_megatron.train",
           f"--config-name={config}", f"run.output_dir={out}", "run.resume=false",
           "run.live_view=false", "run.eval_every=0", "run.samples_per_iteration=0",
           f"run.eval_episodes={eval_episodes}", *overrides]
    done = out / "bench.json"
    if done.exists() and json.loads(done.read_text())["cmd"] == cmd[1:]:
        return json.loads(done.read_text())["seconds"]
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"run {out.name} failed (exit {rc}); see {out.with_suffix('.log')}")
    seconds = time.perf_counter() - t0
    done.write_text(json.dumps({"cmd": cmd[1:], "seconds": seconds}))
    return seconds


def end_value(out: Path, key: str, field: str) -> float:
    evals = json.loads((out / "eval.json").read_text())
    return evals["end"][key][field]


def warm_start(args, root: Path) -> Path:
    """The calculator's warm start, once: its last checkpoint's folder (``run.init``)."""
    out = root / "calculator_warm"
    if not (out / "bench.json").exists():
        print(f"calculator warm start ({args.sft_steps} steps) ...", flush=True)
        train(args, out, ["run.iterations=0", f"sft.steps={args.sft_steps}",
                          f"run.checkpoint_every={args.sft_steps}"], config="tool_use",
              nproc=args.warm_nproc)
    return sorted((out / "checkpoints" / "sft").glob("iter_*"))[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--c4-iterations", type=int, default=20)
    ap.add_argument("--calc-iterations", type=int, default=80)
    ap.add_argument("--sft-steps", type=int, default=1200)
    ap.add_argument("--warm-nproc", type=int, default=4,
                    help="ranks of the calculator's warm start (the recipe's 4)")
    ap.add_argument("--eval-episodes", type=int, default=64)
    ap.add_argument("--calc-eval-episodes", type=int, default=128)
    ap.add_argument("--workloads", default="connect_four,calculator")
    ap.add_argument("--out", default="runs/bench_algorithms")
    args = ap.parse_args()
    root = ROOT / args.out
    recipes = args.recipes.split(",")
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        raise SystemExit(f"--recipes: {unknown} are not in recipes/algorithm/ ({RECIPES})")
    workloads = args.workloads.split(",")
    init = warm_start(args, root) if "calculator" in workloads else None
    rows = {}
    for recipe in recipes:
        row = {}
        for seed in args.seeds:
            common = [f"algorithm={recipe}", f"run.seed={seed}", "run.checkpoint_every=0"]
            if "connect_four" in workloads:
                out = root / f"c4_{recipe}_s{seed}"
                wall = train(args, out, common + [f"run.iterations={args.c4_iterations}"],
                             eval_episodes=args.eval_episodes)
                row.setdefault("c4", []).append(
                    (end_value(out, "random/sampled", "win_rate"), wall))
            if "calculator" in workloads:
                out = root / f"calc_{recipe}_s{seed}"
                wall = train(args, out, common + [f"run.iterations={args.calc_iterations}",
                                                  f"run.init={init}", "sft.steps=0",
                                                  "rollout.tokenizer=tool"],
                             config="tool_use", eval_episodes=args.calc_eval_episodes)
                row.setdefault("calc", []).append(
                    (end_value(out, "calculator/sampled", "mean_reward"), wall))
            print(f"{recipe} seed {seed}: {row}", flush=True)
        rows[recipe] = row
    print()
    print(f"{'recipe':24s} {'connect four win rate':>24s} {'wall s':>8s}   "
          f"{'calculator accuracy':>22s} {'wall s':>8s}")
    for recipe, row in rows.items():
        cells = []
        for key in ("c4", "calc"):
            got = row.get(key, [])
            values = ", ".join(f"{v:.2f}" for v, _ in got) or "-"
            walls = ", ".join(f"{w:.0f}" for _, w in got) or "-"
            cells.append((values, walls))
        print(f"{recipe:24s} {cells[0][0]:>24s} {cells[0][1]:>8s}   "
              f"{cells[1][0]:>22s} {cells[1][1]:>8s}")


if __name__ == "__main__":
    main()
