"""What cached process groups cost while idle: CPU time of a compute-bound loop on 4 gloo ranks
with 1 layout's groups alive versus 4 (runtime/groups.py keeps the groups of recently used
layouts; every gloo group runs a device loop that wakes every 10 ms even when idle).

Prints, from one run, wall and CPU seconds of the same loop (tanh(a @ a), 256 x 256, one thread
per rank) with each cache size, twice, interleaved, and the ratio. With one gloo group per
distinct rank list (runtime/groups.py) the ratio is ~1.01-1.02; with Megatron's 17 groups a
rank it was 1.08-1.24, which is what the aliasing is for.
Run:  python benchmarks/group_cache.py [--world 4] [--steps 1500]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ("tp2-pp2", "pp2-dp2", "dp4", "tp2-dp2")


def _job(cache: int, steps: int):
    import torch
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups

    groups.set_group_cache_size(cache)
    for s in LAYOUTS:
        groups.build_groups(ParallelLayout.parse(s, dist.get_world_size()))
    cached = len(groups.cached_layouts())
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        a = torch.tanh(a @ a)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    dist.barrier()
    groups.destroy_groups()
    return wall, cpu, cached


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500)
    args = p.parse_args(argv)

    from earl_megatron.testing.multiproc import run_distributed

    runs = {1: [], 4: []}
    for cache in (1, 4, 1, 4):
        r = run_distributed(_job, args.world, cache, args.steps, timeout=600)
        runs[cache].append((max(x[0] for x in r), sum(x[1] for x in r), r[0][2]))
    print(f"{args.world} gloo ranks, {args.steps} steps of tanh(a @ a) per rank")
    for cache, rs in runs.items():
        for wall, cpu, cached in rs:
            print(f"  cache {cache} ({cached} layouts alive): wall {wall:.2f} s, CPU {cpu:.2f} s")
    base = [sum(x[i] for x in runs[1]) for i in (0, 1)]
    four = [sum(x[i] for x in runs[4]) for i in (0, 1)]
    print(f"4 layouts cached / 1: wall {four[0] / base[0]:.2f}x, CPU {four[1] / base[1]:.2f}x")


if __name__ == "__main__":
    main()
