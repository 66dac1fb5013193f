"""Weight sync benchmark: the weight plan (runtime/weight_transfer.py) vs the all-gather before it.

Measured, one launch of 4 gloo ranks, one run: train layouts TP2xDP2, PP2xDP2 (a Llama-shaped
model) and EP2xTP2 (a Qwen3-MoE one), pushing to two servers (leaders 0 and 2: a tp2 x dp2
rollout layout) and to one (leader 0: tp4). Both paths do what the sync does before the HTTP /
NCCL push into the servers, which is the same for both and left out: the all-gather
(``testing/baselines.allgather_buckets``: every bucket of every rank's shards to every rank,
pickled, unsharded and converted with ``to_hf`` on every rank) and the plan (``full_weights_at``:
the rows each leader lacks, point to point, ``to_hf`` at the leaders only). Per case: bytes of
weights received by a leader (and the minimum: what it does not hold), by the busiest other
rank, and seconds (slowest rank, median of ``--reps`` after one warm-up). The HF tensors at the
leaders are checked equal between both paths.

Modelled (pure, no launch): the plan's bytes and the link model's seconds
(``plan/weight_plan.transfer_seconds``) beside the all-gather's (``time_model.allgather_seconds``
over the world): a bandwidth-optimal ring all-gather of each bucket (what NCCL would do; across
nodes each node receives the model once, as the plan's leaders do, so the link model prices
them alike), and the padded all_gather_object the sync ran (every rank's part padded to the
largest, one tp group's shard of the bucket, world times; pickling and the host copies not
priced) for the
qwen2.5-7b recipe (8 H100: train TP4xDP2, four tp2 servers) and the qwen2.5-72b recipe
(16 x 8 H100: train TP8xPP4xDP4, sixteen tp8 servers), bf16, 512 MiB buckets.

Run:  python benchmarks/weight_sync.py [--layers 4 --hidden 512 ...] [--reps 3] [--bucket-mb 16]
Its last line: ``weight sync: non-pusher bytes in N, pusher bytes / model X.XXx, time
plan/all-gather Y.YYx`` (N and X over the measured cases, Y: their summed seconds).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [("dense", "tp2xdp2"), ("dense", "pp2xdp2"), ("moe", "ep2xtp2")]
PUSHERS = {"2 servers": (0, 2), "1 server": (0,)}
RECIPES = [("qwen2.5-7b", 1, "tp4xdp2", 2), ("qwen2.5-72b", 16, "tp8xpp4xdp4", 8)]


def _cfg(args, kind):
    from earl_megatron.config.model import ModelConfig

    common = dict(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                  num_attention_heads=args.heads, num_query_groups=args.groups,
                  vocab_size=args.vocab, tie_word_embeddings=False)
    if kind == "moe":
        return ModelConfig(family="qwen3_moe", num_experts=4, moe_ffn_hidden_size=args.ffn // 2,
                           moe_router_topk=2, **common)
    return ModelConfig(family="llama", **common)


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(args):
    import torch
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.weight_plan import minimum_recv_bytes
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.transport import Traffic
    from earl_megatron.runtime.weight_transfer import full_weights_at
    from earl_megatron.testing.baselines import allgather_buckets
    from earl_megatron.weights.hf_mapping import to_hf

    torch.set_num_threads(1)
    me, world = dist.get_rank(), dist.get_world_size()
    bucket = int(args.bucket_mb * 2**20)
    rows = []
    with cpu_backend():
        for kind, name in CASES:
            cfg = _cfg(args, kind)
            lay = ParallelLayout.parse(name, world_size=world, model=cfg)
            mol = build_on_layout(cfg, lay, ddp=False, seed=1)
            for servers, pushers in PUSHERS.items():
                def gathered():
                    got, received = {}, []
                    for full in allgather_buckets(mol, bucket, received):
                        hf = to_hf(cfg, full, partial=True)   # as the old sync: every rank
                        if me in pushers:
                            got.update(hf)
                    return got, sum(received)

                def planned():
                    got, traffic = {}, Traffic()
                    for _, _, full in full_weights_at(mol, pushers, bucket, traffic):
                        if full is not None:
                            got.update(to_hf(cfg, full, partial=True))
                    return got, traffic.bytes_received

                timed = {}
                for how, fn in (("all-gather", gathered), ("plan", planned)):
                    runs = []
                    for _ in range(args.reps + 1):
                        dist.barrier()
                        t0 = time.perf_counter()
                        got, nbytes = fn()
                        runs.append(_slowest(time.perf_counter() - t0))
                    timed[how] = (statistics.median(runs[1:]), nbytes, got)
                same = set(timed["plan"][2]) == set(timed["all-gather"][2]) and all(
                    torch.equal(t, timed["all-gather"][2][k]) for k, t in timed["plan"][2].items())
                rows.append(dict(case=f"{str(lay):8s} -> {servers}", rank=me,
                                 pusher=me in pushers, same=same,
                                 minimum=minimum_recv_bytes(cfg, lay, me) if me in pushers else 0,
                                 model=sum(t.numel() * t.element_size()
                                           for t in timed["plan"][2].values()),
                                 **{f"{h}_s": timed[h][0] for h in timed},
                                 **{f"{h}_bytes": timed[h][1] for h in timed}))
            groups.destroy_groups()
    return rows


def _measured(args) -> tuple[list[str], dict]:
    from earl_megatron.testing.multiproc import run_distributed

    per_rank = run_distributed(_worker, 4, args, timeout=3000)
    lines = [f"{'train layout -> servers':24s} {'leader MB':>9s} {'min MB':>7s} "
             f"{'other MB':>8s} {'all-gather MB':>13s} {'all-gather s':>12s} {'plan s':>7s} "
             f"{'plan/ag':>7s}"]
    worst = {"nonpusher": 0, "pusher_over_model": 0.0, "plan_s": 0.0, "ag_s": 0.0}
    for k in range(len(per_rank[0])):
        rs = [rank[k] for rank in per_rank]
        assert all(r["same"] for r in rs if r["pusher"]), rs[0]["case"]
        model = max(r["model"] for r in rs)
        leader = max(r["plan_bytes"] for r in rs if r["pusher"])
        other = max([r["plan_bytes"] for r in rs if not r["pusher"]], default=0)
        ag_s, plan_s = rs[0]["all-gather_s"], rs[0]["plan_s"]
        worst["nonpusher"] = max(worst["nonpusher"], other)
        worst["pusher_over_model"] = max(worst["pusher_over_model"], leader / model)
        worst["plan_s"] += plan_s
        worst["ag_s"] += ag_s
        lines.append(f"{rs[0]['case']:24s} {leader / 1e6:9.1f} "
                     f"{max(r['minimum'] for r in rs) / 1e6:7.1f} {other / 1e6:8.1f} "
                     f"{max(r['all-gather_bytes'] for r in rs) / 1e6:13.1f} {ag_s:12.3f} "
                     f"{plan_s:7.3f} {plan_s / ag_s:6.2f}x")
    return lines, worst


def _modelled(bucket_bytes: int) -> list[str]:
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.presets import get_preset
    from earl_megatron.plan.specs import ClusterSpec
    from earl_megatron.plan.time_model import allgather_seconds, group_link
    from earl_megatron.plan.weight_plan import FullAt, plan_weights, transfer_seconds

    lines = [f"{'recipe (train -> servers)':38s} {'model GB':>8s} {'leader GB':>9s} "
             f"{'other GB':>8s} {'plan s':>7s} {'ring all-gather s':>17s} "
             f"{'padded all-gather GB/rank':>25s} {'s':>7s}"]
    for preset, nodes, train, server_tp in RECIPES:
        cfg = get_preset(preset)
        cluster = ClusterSpec.h100_80gb(nodes=nodes)
        world = cluster.world_size
        lay = ParallelLayout.parse(train, world_size=world, model=cfg)
        leaders = tuple(range(0, world, server_tp))
        plan = plan_weights(cfg, lay, [FullAt(r) for r in leaders], bucket_bytes=bucket_bytes,
                            devices_per_node=cluster.devices_per_node)
        recv = plan.recv_bytes()
        link = group_link(cluster, ParallelLayout(dp=world), "dp")
        eb = plan.element_bytes
        shapes = dict(plan.row_shapes)
        # a ring all-gather of each bucket over the world (NCCL, bandwidth-optimal), and what
        # the sync's all_gather_object moved: every rank's part padded to the largest one,
        # the bucket's shards of one tp group (tp ranks of dp = cp = 0), world times
        sizes = [sum(math.prod(shapes[n]) for n in b.names) * eb for b in plan.buckets]
        ring = sum(allgather_seconds(size, world, link) for size in sizes)
        padded = sum(world * -(-size // lay.tp) for size in sizes)
        label = f"{preset} ({train} -> {len(leaders)} x tp{server_tp})"
        others = max([recv[r] for r in range(world) if r not in leaders], default=0)
        lines.append(f"{label:38s} {plan.model_bytes / 1e9:8.1f} "
                     f"{max(recv[r] for r in leaders) / 1e9:9.1f} {others / 1e9:8.1f} "
                     f"{transfer_seconds(plan, cluster):7.2f} {ring:17.2f} "
                     f"{padded / 1e9:25.1f} "
                     f"{allgather_seconds(padded, world, link):7.2f}")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=16.0)
    args = p.parse_args(argv)
    lines, worst = _measured(args)
    print("measured, 4 gloo ranks (bytes of weights received; seconds: slowest rank, median)")
    print("\n".join(lines))
    print("\nmodelled (H100 link model, bf16, 512 MiB buckets; leader / other: received by the "
          "busiest pusher / other rank)")
    print("\n".join(_modelled(512 << 20)))
    print(f"weight sync: non-pusher bytes in {worst['nonpusher']}, pusher bytes / model "
          f"{worst['pusher_over_model']:.2f}x, time plan/all-gather "
          f"{worst['plan_s'] / worst['ag_s']:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
