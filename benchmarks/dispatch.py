"""Benchmark: decentralized point-to-point dispatch vs the centralized gather-then-scatter.

Measured on 8 gloo ranks (run_distributed; CPU, loopback): rollout output in producer layout
DP8 moves to a training layout TP2xPP2xDP2, all RL tensors (token ids, loss masks, old and
reference logprobs, advantages, rewards), context lengths 1K..32K. For each: bytes through the
busiest rank and wall time for both strategies, their ratios, and bytes moved vs the minimum.
Then the simulator (earl_megatron.plan.dispatch_sim) prices the same two strategies at 128 and
1,024 ranks on an H100-like cluster. A PNG plot goes to --out.

    python benchmarks/dispatch.py [--out benchmarks/out/dispatch.png] [--batch 32] [--reps 7]

Targets (issue 6): busiest-rank bytes reduced by >= (DP groups)/2, bytes moved <= 1.05 x min,
a speed-up over the centralized baseline that grows with context length.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from earl_megatron.plan.dispatch_sim import H100_CLUSTER, compare_layouts
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import RL_TENSORS
from earl_megatron.testing.multiproc import run_distributed

WORLD = 8
# rollout replicas (DP8) -> a training layout with pipeline stages, and one with wider DP
PAIRS = (("dp8", "tp2-pp2-dp2"), ("dp8", "tp2-dp4"))
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def batch_lengths(ctx: int, batch: int, seed: int = 0) -> dict[int, int]:
    """Episode lengths between 3/4 of the context and the full context."""
    rng = random.Random(seed + ctx)
    return {s: rng.randint(3 * ctx // 4, ctx) for s in range(batch)}


def _bench(pairs, contexts, batch, reps):
    import torch
    import torch.distributed as dist

    from earl_megatron.runtime.dispatcher import (SampleMeta, exchange_metadata,
                                                  execute_shard_map, plan_dispatch)
    from earl_megatron.plan.shard_map import build_centralized_map

    rank = dist.get_rank()
    out = []
    for (prod, cons), ctx in ((pair, ctx) for pair in pairs for ctx in contexts):
        P, C = ParallelLayout.parse(prod, WORLD), ParallelLayout.parse(cons, WORLD)
        lengths = batch_lengths(ctx, batch)
        mine = [SampleMeta(s, n, s // 4) for s, n in lengths.items()
                if s % P.dp == P.coords(rank).dp]
        meta = exchange_metadata(mine)
        t0 = time.perf_counter()
        producer, consumer, smap = plan_dispatch(P, C, meta)
        plan_s = time.perf_counter() - t0
        central = build_centralized_map(producer, consumer)
        g = torch.Generator().manual_seed(rank)
        local: dict = {}
        for p in producer.pieces_of(rank):
            spec = producer.spec[p.tensor]
            n = p.end - p.start
            x = (torch.randint(0, 50_000, (n,), generator=g) if spec.dtype == "int64" else
                 torch.rand(n, generator=g) < 0.5 if spec.dtype == "bool" else
                 torch.randn(n, generator=g))
            local.setdefault(p.tensor, {})[p.sample_id] = x
        row = {"pair": (prod, cons), "ctx": ctx, "plan_s": plan_s, "dec_s": [], "cen_s": []}
        for _ in range(reps):  # interleaved, so both strategies see the same background load
            for name, m in (("dec", smap), ("cen", central)):
                dist.barrier()
                t0 = time.perf_counter()
                res = execute_shard_map(m, producer, consumer, local)
                dist.barrier()  # the dispatch is over when the slowest rank is done
                row[name + "_s"].append(time.perf_counter() - t0)
                row[name + "_bytes"] = res.stats.bytes_sent + res.stats.bytes_received
                row[name + "_out"] = res.tensors
        same = all(torch.equal(row["dec_out"][k][s], row["cen_out"][k][s])
                   for k in row["dec_out"] for s in row["dec_out"][k])
        del row["dec_out"], row["cen_out"]
        row.update(same=same, moved=smap.bytes_moved, min=smap.min_bytes,
                   unique=sum(producer.spec[t].itemsize * (producer.spec[t].elements(n))
                              for t in producer.spec for n in lengths.values()))
        out.append(row)
    return out


def simulate_scale(contexts, worlds=(128, 1024), samples_per_replica=4):
    rows = []
    for world in worlds:
        prod = ParallelLayout(tp=8, dp=world // 8)
        cons = ParallelLayout(tp=8, pp=4, dp=world // 32)
        for ctx in contexts:
            lengths = batch_lengths(ctx, samples_per_replica * prod.dp)
            t0 = time.perf_counter()
            c = compare_layouts(prod, cons, lengths, H100_CLUSTER)
            rows.append(dict(world=world, ctx=ctx, prod=str(prod), cons=str(cons),
                             dec_s=c.decentralized.seconds, cen_s=c.centralized.seconds,
                             speedup=c.speedup, busiest_ratio=c.busiest_ratio,
                             plan_s=time.perf_counter() - t0,
                             moved_ratio=c.decentralized.bytes_moved / c.min_bytes))
    return rows


def plot(measured, simulated, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (prod, cons), style in zip(PAIRS, ("-", ":")):
        rows = [r for r in measured if r["pair"] == (prod, cons)]
        ctx = [r["ctx"] for r in rows]
        name = f"{prod.upper()}->{cons.upper()}"
        a.plot(ctx, [1e3 * r["dec_s"] for r in rows], "o" + style, label=f"{name}, p2p")
        a.plot(ctx, [1e3 * r["cen_s"] for r in rows], "s" + style, label=f"{name}, centralized")
    a.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="wall time (ms)",
          title="measured: 8 gloo ranks on 2 CPU cores")
    a.legend(fontsize=8)
    for world, style in ((128, "-"), (1024, ":")):
        rows = [r for r in simulated if r["world"] == world]
        xs = [r["ctx"] for r in rows]
        b.plot(xs, [1e3 * r["dec_s"] for r in rows], "o" + style, label=f"{world} ranks, p2p")
        b.plot(xs, [1e3 * r["cen_s"] for r in rows], "s" + style,
               label=f"{world} ranks, centralized")
    b.set(xscale="log", yscale="log", xlabel="context length (tokens)",
          ylabel="predicted time (ms)", title="simulated: H100 nodes, TP8 rollout -> TP8xPP4")
    b.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def report_measured(rows, prod, cons, args):
    P, C = ParallelLayout.parse(prod, WORLD), ParallelLayout.parse(cons, WORLD)
    print(f"measured: {WORLD} gloo ranks (CPU), {prod.upper()} -> {cons.upper()}, "
          f"batch {args.batch}, {args.reps} interleaved reps (best ms, median speed-up), "
          f"tensors {[t.name for t in RL_TENSORS]}")
    print(f"{'ctx':>6} {'unique MB':>9} {'busiest MB p2p':>14} {'busiest MB cen':>14} "
          f"{'bytes ratio':>11} {'moved/min':>9} {'p2p ms':>8} {'cen ms':>8} {'speed-up':>8} "
          f"{'plan ms':>7} {'same':>5}")
    for r in rows:
        print(f"{r['ctx']:>6} {r['unique'] / 1e6:>9.2f} {r['dec_bytes'] / 1e6:>14.2f} "
              f"{r['cen_bytes'] / 1e6:>14.2f} {r['cen_bytes'] / r['dec_bytes']:>11.2f} "
              f"{r['moved'] / r['min']:>9.3f} {1e3 * r['dec_s']:>8.1f} {1e3 * r['cen_s']:>8.1f} "
              f"{r['speedup']:>8.2f} {1e3 * r['plan_s']:>7.1f} {str(r['same']):>5}")
    ratios = [r["cen_bytes"] / r["dec_bytes"] for r in rows]
    speed = [r["speedup"] for r in rows]
    print(f"target busiest-rank bytes ratio >= DP groups/2: producer DP{P.dp}/2 = {P.dp / 2:g} "
          f"{'met' if min(ratios) >= P.dp / 2 else 'NOT met'}, consumer DP{C.dp}/2 = "
          f"{C.dp / 2:g} {'met' if min(ratios) >= C.dp / 2 else 'NOT met'} (min ratio "
          f"{min(ratios):.2f})")
    print(f"target bytes moved <= 1.05 x min: max {max(r['moved'] / r['min'] for r in rows):.3f}")
    print(f"speed-up by context: {' '.join(f'{s:.2f}' for s in speed)}; last > first: "
          f"{'yes' if speed[-1] > speed[0] else 'no'}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/out/dispatch.png")
    ap.add_argument("--batch", type=int, default=32, help="samples per dispatch (8 ranks)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions, interleaved")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]

    t0 = time.perf_counter()
    per_rank = run_distributed(_bench, WORLD, PAIRS, contexts, args.batch, args.reps,
                               timeout=900, collective_timeout_s=300)

    def wall(rs, key):  # a rep lasts as long as its slowest rank
        return [max(r[key][i] for r in rs) for i in range(args.reps)]

    rows = []
    for i in range(len(per_rank[0])):
        rs = [per_rank[r][i] for r in range(WORLD)]
        dec, cen = wall(rs, "dec_s"), wall(rs, "cen_s")
        rows.append(dict(pair=rs[0]["pair"], ctx=rs[0]["ctx"], dec_s=min(dec), cen_s=min(cen),
                         speedup=statistics.median(c / d for c, d in zip(cen, dec)),
                         dec_bytes=max(r["dec_bytes"] for r in rs),
                         cen_bytes=max(r["cen_bytes"] for r in rs),
                         moved=rs[0]["moved"], min=rs[0]["min"], unique=rs[0]["unique"],
                         plan_s=max(r["plan_s"] for r in rs), same=all(r["same"] for r in rs)))
    for prod, cons in PAIRS:
        report_measured([r for r in rows if r["pair"] == (prod, cons)], prod, cons, args)
    sim = simulate_scale(contexts)
    print("\nsimulated (H100-like: 8 ranks/node, NIC 50 GB/s/rank, NVLink 450 GB/s, 10 us), "
          "4 samples per rollout replica:")
    print(f"{'ranks':>5} {'layouts':>24} {'ctx':>6} {'p2p ms':>8} {'cen ms':>8} {'speed-up':>8} "
          f"{'busiest ratio':>13} {'moved/min':>9} {'plan+sim s':>10}")
    for r in sim:
        print(f"{r['world']:>5} {r['prod'] + '->' + r['cons']:>24} {r['ctx']:>6} "
              f"{1e3 * r['dec_s']:>8.3f} {1e3 * r['cen_s']:>8.2f} {r['speedup']:>8.1f} "
              f"{r['busiest_ratio']:>13.1f} {r['moved_ratio']:>9.3f} {r['plan_s']:>10.2f}")
    plot(rows, sim, args.out)
    print(f"\nplot: {args.out}   total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
