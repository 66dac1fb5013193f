"""Benchmark: the CPU demo learning on SGLang servers, beside the embedded engine (issue 14).

Runs the main job (recipes/config.yaml: tiny Llama, Connect Four against random, REINFORCE++)
twice with the same seed and overrides, once per rollout engine, each a real
``torchrun -m earl_megatron.train``: ``rollout.engine=embedded`` and ``rollout=sglang`` with
real SGLang CPU servers (``rollout.sglang_device=cpu``, the venv ``make sglang`` builds), the
recipe's 64 episodes and 4 action tokens per turn. Layouts are fixed (``--rollout``, default
dp2: two servers; ``--train`` dp2) so both runs use the same ones, under a 1 GB per-rank budget
(the recipe's 0.25 GB holds no static layout once games get long). Prints per iteration reward
and win rate of both runs side by side, then the evaluations (greedy and sampled win rate
against random on held-out seeds) at the start, every ``--eval-every`` iterations and at the
end, and for each engine the sampled win-rate gain.
Target: SGLang's sampled win rate against random rises by >= 0.2 within the run.

    python benchmarks/sglang_learning.py [--iterations 12] [--nproc 2] [--rollout dp2]
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
# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(ROOT))


def run(engine: str, args, out: Path) -> float:
    # a fresh run each time: run.resume=false refuses a folder holding an earlier run
    shutil.rmtree(out, ignore_errors=True)
    over = [f"run.iterations={args.iterations}", f"run.output_dir={out}", "run.resume=false",
            "run.live_view=false", "run.checkpoint_every=0", f"run.eval_every={args.eval_every}",
            f"run.eval_episodes={args.eval_episodes}", "layout=static",
            "layout.memory_budget_gb=1",
            f"layout.rollout={args.rollout}", f"layout.logprob={args.rollout}",
            f"layout.train={args.train}"]
    if engine == "sglang":
        over += ["rollout=sglang", "rollout.sglang_device=cpu", "rollout.episodes_per_iteration=64",
                 "rollout.max_action_tokens=4", f"rollout.sglang_python={args.sglang_python}"]
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "earl_megatron.train", *over]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{engine} run failed (exit {rc}); see {out.with_suffix('.log')}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=6)
    ap.add_argument("--eval-episodes", type=int, default=64)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rollout", default="dp2", help="static rollout (and logprob) layout")
    ap.add_argument("--train", default="dp2", help="static train layout")
    ap.add_argument("--sglang-python",
                    default=str(Path("~/.cache/earl-sglang-cpu/bin/python").expanduser()))
    ap.add_argument("--out", default="runs/sglang_learning")
    args = ap.parse_args()
    if not Path(args.sglang_python).is_file():
        raise SystemExit(f"no SGLang python at {args.sglang_python}: `make sglang` builds one")
    base = (ROOT / args.out).resolve()
    base.mkdir(parents=True, exist_ok=True)
    walls, hist, evals = {}, {}, {}
    for engine in ("embedded", "sglang"):
        walls[engine] = run(engine, args, base / engine)
        hist[engine] = [json.loads(x) for x in (base / engine / "metrics.jsonl").read_text()
                        .splitlines() if '"iteration"' in x]
        evals[engine] = json.loads((base / engine / "eval.json").read_text())
    print(f"Connect Four vs random, tiny Llama, REINFORCE++, {args.nproc} ranks, rollout "
          f"{args.rollout}, {args.iterations} iterations, seed 0 (recipes/config.yaml)")
    print(f"{'it':>3} | {'embedded reward':>15} {'win':>5} | {'sglang reward':>13} {'win':>5} "
          f"{'logp diff max':>13}")
    for e, s in zip(hist["embedded"], hist["sglang"], strict=True):
        print(f"{e['iteration']:>3} | {e['reward']:>15.3f} {e['win_rate']:>5.2f} | "
              f"{s['reward']:>13.3f} {s['win_rate']:>5.2f} {s['rollout_logprob_diff_max']:>13.1e}")
    print("evaluations vs random (greedy / sampled win rate):")
    for when in evals["embedded"]:
        row = [f"{when:>6}"]
        for engine in ("embedded", "sglang"):
            r = evals[engine].get(when, {})
            g, s = r.get("random/greedy", {}), r.get("random/sampled", {})
            row.append(f"{engine} {g.get('win_rate', float('nan')):.2f} / "
                       f"{s.get('win_rate', float('nan')):.2f}")
        print("  " + "   ".join(row))
    for engine in ("embedded", "sglang"):
        ev = evals[engine]
        gain = ev["end"]["random/sampled"]["win_rate"] - ev["start"]["random/sampled"]["win_rate"]
        print(f"{engine}: sampled win rate gain {gain:+.2f} (target >= +0.20), "
              f"{walls[engine]:.0f} s wall")


if __name__ == "__main__":
    main()
