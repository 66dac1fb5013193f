"""Benchmark: does the selector pick the fastest TRAIN layout? Measured on 4 CPU ranks.

    python benchmarks/selector.py [--contexts 64,128,256,512,1024] [--load 4] [--rounds 2] \\
        [--calibration other_run.json] [--measured measured.json] [--out-dir benchmarks/out]

1. Measure: ``torchrun --standalone --nproc-per-node 4 tools/profile_layouts.py --stages train``
   times one TRAIN step (``train_step``: forward/backward + Adam, Megatron's distributed
   optimizer) of the tiny model for every valid layout (10 on 4 ranks) and context length, with
   ``--load`` sequences per global batch and one sequence per micro-batch. ``--measured FILE``
   skips this and reads an earlier measurement instead.
2. Choose: for each context, ``Selector(tiny, ClusterSpec.cpu(4)).plan(StageWorkload.of(TRAIN,
   context, load, micro_batch_tokens=context))`` from a fresh state (no hysteresis, no switch
   cost), with three sources of time:
   - analytic: the time model alone;
   - loco: calibrated by a ProfileTable of this run's measurements at the OTHER context lengths
     (leave one context out: the measured point itself never leaks into its own choice);
   - other run: calibrated by ``--calibration``, a ProfileTable from a separate, earlier run of
     tools/profile_layouts.py (independent measurements, possibly at other contexts and loads).
3. Score: the choice's measured seconds / the fastest layout's measured seconds at the context.
   Printed per context and summarised as: hits (picked the measured fastest) out of contexts,
   the mean ratio when it missed, the mean ratio over all contexts, and how often the pick is
   within 10% of the fastest (closer than the run-to-run noise here). Two references put the
   numbers in scale: a fixed layout (DP4, plain data parallel) and the mean ratio of a layout
   drawn uniformly at random.

The measurement is wall-clock on a shared machine: a repeat of the same point can differ by
tens of percent when other processes compete for the cores (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(ROOT))

from earl_megatron.config.model import FAMILIES, ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.selector import Selector, SelectorState
from earl_megatron.plan.specs import Stage, StageWorkload, TrainOptions, cluster_spec
from earl_megatron.plan.tensor_table import num_parameters

WORLD = 4
FIXED = ParallelLayout(dp=4)
NEAR = 0.10
"""A pick within 10% of the fastest is also counted: repeats of one point differ by more."""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def measure(args, out: Path) -> None:
    """Run the profiler under torchrun (4 ranks, one intra-op thread each)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", str(ROOT / "tools" / "profile_layouts.py"),
           "--out", str(out), "--stages", "train", "--family", args.family,
           "--contexts", ",".join(map(str, args.contexts)), "--loads", str(args.load),
           "--rounds", str(args.rounds), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup)]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


def train_entries(table: ProfileTable, load: int) -> dict[int, dict[ParallelLayout, float]]:
    """context -> layout -> measured seconds of the TRAIN points at ``load``."""
    out: dict[int, dict[ParallelLayout, float]] = {}
    for e in table.entries:
        if e.stage == Stage.TRAIN.value and e.load == load:
            out.setdefault(e.context_bucket, {})[e.layout] = e.seconds
    if not out:
        raise SystemExit(f"no TRAIN entries with load {load} in the measured table")
    return out


def without_context(table: ProfileTable, context: int) -> ProfileTable:
    """The table minus every entry at ``context`` (leave-one-context-out calibration)."""
    return ProfileTable(tuple(e for e in table.entries if e.context_bucket != context),
                        table.meta)


def choose(selector: Selector, context: int, load: int) -> ParallelLayout:
    wl = StageWorkload.of(Stage.TRAIN, context, load, micro_batch_tokens=context)
    plan, _ = selector.plan(wl, current=None, state=SelectorState())
    return plan.layout


def score(picks: dict[int, ParallelLayout], measured: dict[int, dict[ParallelLayout, float]]
          ) -> tuple[int, int, Optional[float], float, int]:
    """(hits, contexts, mean ratio when missed or None, mean ratio overall, picks within
    ``NEAR`` of the fastest)."""
    ratios = []
    for ctx, lay in picks.items():
        times = measured[ctx]
        if lay not in times:
            raise SystemExit(f"selector chose {lay} at context {ctx}, which was not measured")
        ratios.append(times[lay] / min(times.values()))
    missed = [r for r in ratios if r > 1.0]
    return (len(ratios) - len(missed), len(ratios),
            statistics.fmean(missed) if missed else None, statistics.fmean(ratios),
            sum(r <= 1 + NEAR for r in ratios))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=_ints, default=(64, 128, 256, 512, 1024))
    ap.add_argument("--load", type=int, default=4, help="sequences per global batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--family", choices=FAMILIES, default="llama")
    ap.add_argument("--measured", help="use this measurement instead of measuring")
    ap.add_argument("--calibration", help="ProfileTable from a different run (calibration)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args(argv)

    cfg = ModelConfig.tiny(args.family)
    if args.measured:
        path = Path(args.measured)
    else:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        path = Path(args.out_dir) / "selector_measured.json"
        measure(args, path)
    table = ProfileTable.load(path)
    meta = dict(table.meta)
    if meta.get("model") != repr(cfg):
        raise SystemExit(f"{path} measured {meta.get('model')}, not {cfg!r}")
    if meta.get("micro_batch_size", "1") != "1":
        raise SystemExit(f"{path} used micro-batches of {meta['micro_batch_size']} sequences; "
                         "this benchmark models one sequence per micro-batch")
    measured = train_entries(table, args.load)
    contexts = sorted(measured)
    opts = TrainOptions(distributed_optimizer=meta.get("distributed_optimizer", "True") == "True")
    cluster = cluster_spec("cpu", nodes=1, devices_per_node=WORLD)
    analytic = Selector(cfg, cluster, opts)

    sources = {"analytic": {c: choose(analytic, c, args.load) for c in contexts}}
    sources["loco"] = {c: choose(Selector(cfg, cluster, opts, profile=without_context(table, c)),
                                 c, args.load) for c in contexts}
    if args.calibration:
        other = ProfileTable.load(args.calibration)
        if dict(other.meta).get("model") != repr(cfg):
            raise SystemExit(f"{args.calibration} profiled another model")
        sel = Selector(cfg, cluster, opts, profile=other)
        sources["other run"] = {c: choose(sel, c, args.load) for c in contexts}

    print(f"\nTRAIN step, tiny {cfg.family} ({num_parameters(cfg):,} params), {WORLD} CPU ranks, "
          f"{args.load} sequences per batch, 1 per micro-batch; measured {meta.get('date', '?')}, "
          f"load average at start {meta.get('load_average_at_start', '?')} on "
          f"{meta.get('cpu_count', '?')} cores; {meta.get('statistic', '')} "
          f"({meta.get('rounds', '?')} rounds x {meta.get('repeats', '?')} repeats)")
    layouts = sorted({lay for times in measured.values() for lay in times})
    print("ms per step   " + " ".join(f"{str(lay):>9s}" for lay in layouts)
          + "   fastest   " + "  ".join(f"{k:>16s}" for k in sources))
    for c in contexts:
        times = measured[c]
        best = min(times, key=times.get)
        cells = " ".join(f"{1000 * times[lay]:9.1f}" if lay in times else f"{'-':>9s}"
                         for lay in layouts)
        picks = "  ".join(f"{str(sources[k][c]):>9s} x{times[sources[k][c]] / times[best]:.3f}"
                          .rjust(16) for k in sources)
        print(f"context {c:5d} {cells}   {str(best):>7s}   {picks}")
    print()
    rows = dict(sources)
    rows[f"fixed {FIXED}"] = {c: FIXED for c in contexts}
    for name, picks in rows.items():
        hits, n, miss, mean, near = score(picks, measured)
        miss_text = f"{miss:.2f}x" if miss is not None else "n/a"
        print(f"{name:>10s}: picked the fastest in {hits}/{n} contexts ({hits / n:.2f}); "
              f"mean slowdown when not {miss_text}; mean ratio to fastest {mean:.2f}x; "
              f"within {100 * NEAR:.0f}% of the fastest in {near}/{n}")
    rand = statistics.fmean(statistics.fmean(t / min(times.values()) for t in times.values())
                            for times in measured.values())
    print(f"{'random':>10s}: a uniformly random layout: mean ratio to fastest {rand:.2f}x, "
          f"fastest with probability {statistics.fmean(1 / len(t) for t in measured.values()):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
