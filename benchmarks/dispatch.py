"""Benchmark: decentralized point-to-point dispatch vs the centralized gather-then-scatter.

Measured on 8 gloo ranks (run_distributed; CPU, loopback): rollout output in producer layout DP8
moves to a training layout TP2xPP2xDP2, exactly what the trainer sends to TRAIN
(runtime/step_inputs.train_tensors: input_ids, labels, float loss_mask, old_logprobs, advantages;
with --ref also ref_logprobs), every tensor produced on every pp_stage of the rollout replica as
the trainer declares it, context lengths 1K..32K. For each: bytes through the busiest rank and wall
time for both strategies, their ratios, bytes moved vs the minimum, and the simulator's prediction
for the same maps on ``ClusterSpec.cpu(ranks=8)`` beside the measurement.
Then the simulator (earl_megatron.plan.dispatch_sim) prices the EARL paper's case: 128 ranks
(16 nodes x 8 H100, 200 Gbps per node), logprobs only, TP8xDP16 -> TP8xPP4xDP4, 8K/16K/32K,
against both centralized baselines (a GPU rank as root; a TCP controller process), with the
model's assumptions listed. A PNG plot goes to --out.

    python benchmarks/dispatch.py [--out benchmarks/out/dispatch.png] [--batch 32] [--reps 7]

Targets (issue 6): busiest-rank bytes reduced by >= (DP groups)/2, bytes moved <= 1.05 x min,
a speed-up over the centralized baseline that grows with context length.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_megatron.plan.dispatch_sim import (ControllerSpec, compare_layouts, h100_cluster,
                                             simulate)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import TensorSpec
from earl_megatron.plan.specs import cluster_spec
from earl_megatron.testing.multiproc import run_distributed
from earl_megatron.runtime.step_inputs import train_tensors

LOGPROBS = (TensorSpec("old_logprobs", "float32", True, "last"),)
"""The paper's dispatched tensor: logprobs, produced on the LOGPROB layout's last pp_stage."""

WORLD = 8
# rollout replicas (DP8) -> a training layout with pipeline stages, and one with wider DP
PAIRS = (("dp8", "tp2-pp2-dp2"), ("dp8", "tp2-dp4"))
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def batch_lengths(ctx: int, batch: int, seed: int = 0) -> dict[int, int]:
    """Episode lengths between 3/4 of the context and the full context."""
    rng = random.Random(seed + ctx)
    return {s: rng.randint(3 * ctx // 4, ctx) for s in range(batch)}


def _bench(pairs, contexts, batch, reps, tensors):
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
        producer, consumer, smap = plan_dispatch(
            P, C, meta, tensors, producer_pp_stages={t.name: "all" for t in tensors})
        plan_s = time.perf_counter() - t0
        central = build_centralized_map(producer, consumer)
        cpu = cluster_spec("cpu", nodes=1, devices_per_node=WORLD)
        sim = (simulate(smap, cpu).seconds, simulate(central, cpu).seconds)
        g = torch.Generator().manual_seed(rank)
        local: dict = {}
        for p in producer.pieces_of(rank):
            spec = producer.spec[p.tensor]
            n = p.end - p.start
            x = (torch.randint(0, 50_000, (n,), generator=g) if spec.dtype == "int64" else
                 (torch.rand(n, generator=g) < 0.5).float() if spec.name == "loss_mask" else
                 torch.randn(n, generator=g))
            local.setdefault(p.tensor, {})[p.sample_id] = x
        row = {"pair": (prod, cons), "ctx": ctx, "plan_s": plan_s, "dec_s": [], "cen_s": [],
               "sim_dec_s": sim[0], "sim_cen_s": sim[1]}
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


def simulate_scale(contexts, samples_per_replica=128, controller=ControllerSpec()):
    """The EARL paper's logprob case on 16 x 8 H100 (see the module docstring)."""
    cluster = h100_cluster(16)
    prod, cons = ParallelLayout(tp=8, dp=16), ParallelLayout(tp=8, pp=4, dp=4)
    rows = []
    for ctx in contexts:
        lengths = {s: ctx for s in range(samples_per_replica * prod.dp)}
        t0 = time.perf_counter()
        c = compare_layouts(prod, cons, lengths, cluster, LOGPROBS, controller=controller)
        rows.append(dict(world=cluster.world_size, ctx=ctx, prod=str(prod), cons=str(cons),
                         per_worker=samples_per_replica * ctx * 4, dec=c.decentralized,
                         root=c.gpu_root, ctl=c.controller, speedup=c.speedup,
                         root_speedup=c.gpu_root_speedup, plan_s=time.perf_counter() - t0,
                         moved_ratio=c.decentralized.bytes_moved / c.min_bytes))
    return rows, cluster, controller


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
    xs = [r["ctx"] for r in simulated]
    for key, mark, label in (("dec", "o-", "p2p"), ("root", "s:", "GPU root"),
                             ("ctl", "^--", "TCP controller")):
        b.plot(xs, [1e3 * r[key].seconds for r in simulated], mark, label=label)
    b.set(xscale="log", yscale="log", xlabel="context length (tokens)",
          ylabel="predicted time (ms)",
          title="simulated: 128 x H100, 200 Gbps/node, logprobs TP8xDP16 -> TP8xPP4xDP4")
    b.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def report_measured(rows, prod, cons, args):
    P, C = ParallelLayout.parse(prod, WORLD), ParallelLayout.parse(cons, WORLD)
    print(f"measured: {WORLD} gloo ranks (CPU), {prod.upper()} -> {cons.upper()}, "
          f"batch {args.batch}, {args.reps} interleaved reps (best ms, median speed-up), "
          f"tensors {args.tensor_names}")
    print(f"{'ctx':>6} {'unique MB':>9} {'busiest MB p2p':>14} {'busiest MB cen':>14} "
          f"{'bytes ratio':>11} {'moved/min':>9} {'p2p ms':>8} {'cen ms':>8} {'speed-up':>8} "
          f"{'plan ms':>7} {'same':>5} {'sim p2p':>8} {'sim cen':>8} {'sim/meas':>8}")
    for r in rows:
        print(f"{r['ctx']:>6} {r['unique'] / 1e6:>9.2f} {r['dec_bytes'] / 1e6:>14.2f} "
              f"{r['cen_bytes'] / 1e6:>14.2f} {r['cen_bytes'] / r['dec_bytes']:>11.2f} "
              f"{r['moved'] / r['min']:>9.3f} {1e3 * r['dec_s']:>8.1f} {1e3 * r['cen_s']:>8.1f} "
              f"{r['speedup']:>8.2f} {1e3 * r['plan_s']:>7.1f} {str(r['same']):>5} "
              f"{1e3 * r['sim_dec_s']:>8.1f} {1e3 * r['sim_cen_s']:>8.1f} "
              f"{(r['sim_cen_s'] / r['sim_dec_s']) / r['speedup']:>8.2f}")
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
    ap.add_argument("--ref", action="store_true",
                    help="also send ref_logprobs (the trainer does with kl_mode=loss)")
    ap.add_argument("--sim-samples", type=int, default=128,
                    help="samples per rollout replica in the simulated 128-rank case")
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    tensors = train_tensors(with_ref=args.ref)
    args.tensor_names = [t.name for t in tensors]

    t0 = time.perf_counter()
    per_rank = run_distributed(_bench, WORLD, PAIRS, contexts, args.batch, args.reps, tensors,
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
                         plan_s=max(r["plan_s"] for r in rs), same=all(r["same"] for r in rs),
                         sim_dec_s=rs[0]["sim_dec_s"], sim_cen_s=rs[0]["sim_cen_s"]))
    for prod, cons in PAIRS:
        report_measured([r for r in rows if r["pair"] == (prod, cons)], prod, cons, args)
    sim_ctx = [c for c in contexts if c >= 8192] or contexts
    sim, cluster, ctl = simulate_scale(sim_ctx, args.sim_samples)
    print(f"\nsimulated: {cluster.name}, logprobs only (float32), {args.sim_samples} samples per "
          "rollout replica. Assumptions: network per NODE "
          f"{cluster.inter_node_bandwidth / 1e9:g} GB/s shared by its {cluster.devices_per_node} "
          f"ranks, NVLink {cluster.intra_node_bandwidth / 1e9:g} GB/s per rank, "
          f"{1e6 * cluster.inter_node_latency_s:g} us per message, contention only on a node's "
          f"own links, one message per peer per round; TCP controller on node 0 moving "
          f"{ctl.bandwidth / 1e9:g} GB/s in total, {1e6 * ctl.latency_s:g} us per message; "
          "rank 0's own data not re-sent by either baseline")
    print(f"{'ctx':>6} {'MiB/worker':>10} {'p2p ms':>8} {'GPU root ms':>11} {'ctl ms':>8} "
          f"{'ctl/p2p':>8} {'root/p2p':>8} {'busiest link p2p':>18} {'moved/min':>9} "
          f"{'plan+sim s':>10}")
    for r in sim:
        print(f"{r['ctx']:>6} {r['per_worker'] / 2**20:>10.1f} {1e3 * r['dec'].seconds:>8.2f} "
              f"{1e3 * r['root'].seconds:>11.1f} {1e3 * r['ctl'].seconds:>8.1f} "
              f"{r['speedup']:>8.1f} {r['root_speedup']:>8.1f} {r['dec'].busiest_link:>18} "
              f"{r['moved_ratio']:>9.3f} {r['plan_s']:>10.2f}")
    plot(rows, sim, args.out)
    print(f"\nplot: {args.out}   total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
