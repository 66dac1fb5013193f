"""Benchmark: SmolLM2-135M-Instruct's calculator accuracy before and after RL (issue 23).

Three real ``torchrun -m earl_megatron.train --config-name smollm2_tool`` jobs on the fixture
directory (``make smollm2``), each on ``--nproc`` CPU ranks, ``--episodes`` held-out questions
evaluated greedy and sampled (temperature 1) by the trainer's own evaluation:

    base, tool described    sft.steps=0 run.iterations=0 (the recipe's JSON tool prompt)
    base, no tool           the same with a system prompt that asks for <answer>N</answer> only
    recipe                  the warm start, then RL (run.iterations, default the recipe's 30):
                            "start" is after the warm start (the start of RL), "end" after RL

Prints each evaluation's accuracy and tool calls per episode, the RL run's accuracy gain over
the start of RL (target: +0.2 within 30 minutes of RL on a 2-core machine), its wall-clock
split (RL iterations: rollout / train / switch / weight sync, and the whole job with the warm
start and evaluations) and the RL minutes. ``--skip-base`` runs the recipe alone; ``--only-base`` the two base evaluations.

    python benchmarks/real_tool_use.py [--nproc 2] [--episodes 128] [--iterations 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(ROOT))

NO_TOOL_PROMPT = ("Answer the arithmetic question. Give your final answer as "
                  "<answer>391</answer>.")


def train(out: Path, nproc: int, *overrides: str) -> float:
    """One torchrun job of the recipe; returns its wall-clock seconds."""
    from earl_megatron.testing.smollm2 import ensure_smollm2

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(nproc), "-m", "earl_megatron.train",
                    "--config-name", "smollm2_tool", f"run.init={ensure_smollm2(install=False)}",
                    f"run.output_dir={out}", "run.live_view=false", "run.resume=false",
                    *overrides], env=env, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def evals(out: Path) -> dict:
    return json.loads((out / "eval.json").read_text())


def line(name: str, ev: dict) -> str:
    g, s = ev["calculator/greedy"], ev["calculator/sampled"]
    return (f"{name:<28} greedy acc {g['accuracy']:.3f} tools {g['tool_calls']:.2f}   "
            f"sampled acc {s['accuracy']:.3f} tools {s['tool_calls']:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--iterations", type=int, default=None, help="RL iterations (recipe: 30)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "real_tool_use"))
    group = p.add_mutually_exclusive_group()
    group.add_argument("--skip-base", action="store_true")
    group.add_argument("--only-base", action="store_true")
    a = p.parse_args()
    root = Path(a.out)
    common = [f"run.eval_episodes={a.episodes}"]
    rows = []
    if not a.skip_base:
        base = ["sft.steps=0", "run.iterations=0", *common]
        train(root / "base_tool", a.nproc, *base)
        rows.append(line("base, tool described", evals(root / "base_tool")["start"]))
        train(root / "base_no_tool", a.nproc, *base,
              f"env.kwargs.system_prompt='{NO_TOOL_PROMPT}'")
        rows.append(line("base, no tool", evals(root / "base_no_tool")["start"]))
    if not a.only_base:
        extra = [f"run.iterations={a.iterations}"] if a.iterations is not None else []
        wall = train(root / "recipe", a.nproc, *common, *extra)
        ev = evals(root / "recipe")
        rows.append(line("after warm start (RL start)", ev["start"]))
        rows.append(line("after RL", ev["end"]))
        metrics = [json.loads(x) for x in (root / "recipe" / "metrics.jsonl").read_text()
                   .splitlines()]
        rl_s = sum(m["seconds"]["total"] for m in metrics)
        split = {k: sum(m["seconds"].get(k, 0.0) for m in metrics)
                 for k in ("rollout", "train", "switch", "weight_sync", "plan+switch")}
        gain = ev["end"]["calculator/sampled"]["accuracy"] - \
            ev["start"]["calculator/sampled"]["accuracy"]
        rows.append(f"RL: {len(metrics)} iterations in {rl_s / 60:.1f} min "
                    f"({rl_s / len(metrics):.1f} s/it: " +
                    ", ".join(f"{k} {v / len(metrics):.1f}" for k, v in split.items()) + "); "
                    f"the whole job (warm start, evaluations, RL) {wall / 60:.1f} min")
        rows.append(f"sampled accuracy gain over the start of RL: {gain:+.3f} (target +0.2)")
        first = next((m["iteration"] for m in metrics
                      if m["accuracy"] >= ev["start"]["calculator/sampled"]["accuracy"] + 0.2),
                     None)
        rows.append(f"first iteration whose rollout accuracy is +0.2 over the start: {first}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
