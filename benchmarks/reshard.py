"""Layout switch benchmark: in-memory reshard vs dist_checkpointing round trip vs Megatron's refit.

For each layout pair (on 4 and 8 gloo ranks, one launch per world size) on a model with
>= 100 MB of fp32 weights, measures:

- in-memory   runtime/switcher.switch_layout: plan + collect, fixed cost (free the old model,
              regroup, build the new one without random init) and transfer time, bytes sent,
              rounds: A -> B the first time (B's groups are created), back, then A -> B -> A
              again with both layouts' groups cached (the steady state between RL stages),
              over shared memory ("auto" on one host) and over batched isend/irecv;
- disk        dist_checkpointing save under A, the same rebuild (B's groups cached, like the
              steady in-memory switch), load under B (weights only), bytes written;
- megatron    megatron.core.resharding.swap_model_weights (gloo copy service) between a live
              model in A and a second live model in B built on its own HyperCommGrid groups
              (both resident); first swap (plans) and a second, steady one; weights only;
- minimum     the bytes any plan must move (plan/reshard_plan.py).

Every path is checked: the sum of squares of all weights (double) is the same after the switch.
Run:  python benchmarks/reshard.py [--worlds 4 8] [--layers 8 --hidden 512 ...] [--experts 8]
(``--experts``: a mixture-of-experts model and EP / ETP pairs; Megatron's refit is skipped there,
its HyperCommGrid groups have no expert axes.)
Fixed costs (regroup + model construction) are printed apart from data movement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIRS = {
    4: [("tp2-pp2", "tp4"), ("pp4", "tp2-dp2"), ("tp4", "pp2-dp2")],
    8: [("tp2-pp2-dp2", "tp4-pp2"), ("pp4-dp2", "tp4-dp2")],
}
MOE_PAIRS = {   # --experts E: a qwen3_moe model; experts move between EP / ETP layouts
    4: [("dp4", "ep4"), ("ep2", "ep2xtp2"), ("ep4", "ep2,tp2,etp1")],
    8: [("ep2xdp8", "ep8"), ("ep4xtp2", "ep2xtp4,etp1")],
}


def _cfg(args):
    from earl_megatron.config.model import ModelConfig

    if getattr(args, "experts", 0):
        return ModelConfig(family="qwen3_moe", num_layers=args.layers, hidden_size=args.hidden,
                           ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
                           num_query_groups=args.groups, vocab_size=args.vocab,
                           num_experts=args.experts, moe_ffn_hidden_size=args.ffn // 2,
                           moe_router_topk=2)
    return ModelConfig(family="llama", num_layers=args.layers, hidden_size=args.hidden,
                       ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
                       num_query_groups=args.groups, vocab_size=args.vocab)


def _sumsq(module, cfg, layout, coords) -> float:
    """Sum of squares of every full weight (each element once), identical on every rank."""
    import torch
    import torch.distributed as dist

    from earl_megatron.plan.tensor_table import tensor_table

    table = tensor_table(cfg)
    local = torch.zeros(1, dtype=torch.float64)
    rank = dist.get_rank()
    dense = coords.dp == 0 and coords.cp == 0
    expert = layout.expert_coords(rank).edp == 0     # an expert's replicas are its edp ranks
    for name, p in module.named_parameters():
        row = table.row(table.global_name_on(name, layout, rank))
        # a tied output layer repeats the embedding; replicated rows repeat over tp
        if not row.tied_to and (expert if row.expert is not None else dense) \
                and (row.split_dim is not None or row.tp_rank_of(layout, rank) == 0):
            local += p.detach().double().pow(2).sum()
    dist.all_reduce(local)
    return local.item()


def _sync_replicas(mol) -> None:
    """Make dp x cp replicas equal: Megatron's CPU init without weights differs per dp rank."""
    import torch.distributed as dist

    from earl_megatron.runtime import groups

    g = groups.dp_group(with_context_parallel=True)
    root = dist.get_process_group_ranks(g)[0]
    for p in mol.module().parameters():
        dist.broadcast(p.data, src=root, group=g)


def _maxed(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _summed(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _megatron_swap(mol, dst_layout, cfg):
    """Megatron's refit into a second live model in ``dst_layout``; returns timings and sumsq."""
    import torch.distributed as dist
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.resharding import swap_model_weights
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

    from earl_megatron.models.provider import build_gpt_model, transformer_config

    b = dst_layout
    t0 = time.perf_counter()
    grid = HyperCommGrid([b.tp, b.cp, b.dp, b.pp], ["tp", "cp", "dp", "pp"], backend="gloo")
    pgs = {k: grid.create_pg(k) for k in ("tp", "cp", "dp", "pp")}
    pgc = ProcessGroupCollection(tp=pgs["tp"], cp=pgs["cp"], pp=pgs["pp"], dp=pgs["dp"],
                                 embd=None)
    c = b.coords(dist.get_rank())
    # no random init, as for the other two paths (the swap overwrites every weight)
    target = build_gpt_model(cfg, b, pre_process=c.pp == 0, post_process=c.pp == b.pp - 1,
                             config=transformer_config(cfg, b, perform_initialization=False),
                             pg_collection=pgc)
    service = GlooCopyService()
    t1 = time.perf_counter()
    times = []
    for _ in range(2):
        dist.barrier()
        s = time.perf_counter()
        swap_model_weights([mol.module()], [target], refit_method=service)
        dist.barrier()
        times.append(time.perf_counter() - s)
    sumsq = _sumsq(target, cfg, b, c)
    del target
    for pg in list(pgs.values()) + [service.gloo_pg]:
        dist.destroy_process_group(pg)
    # the second model is a reference cycle holding the grid's gloo groups: collect it here, or
    # the next automatic collection (inside a timed switch) pays for it (~0.25 s, measured)
    del pg, pgs, pgc, service, grid
    gc.collect()
    return dict(fixed_s=t1 - t0, first_s=times[0], steady_s=times[1], sumsq=sumsq)


def _cpu() -> float:
    """CPU seconds of this rank: all its threads (gloo's included) and its reaped children."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _job(pairs, args_dict, tmp_root):
    import torch.distributed as dist

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.switcher import SwitchStats, switch_layout
    from earl_megatron.testing.baselines import switch_via_checkpoint

    args = argparse.Namespace(**args_dict)
    cfg = _cfg(args)
    groups.set_group_cache_size(args.group_cache)
    world, rank = dist.get_world_size(), dist.get_rank()
    lay = lambda s: ParallelLayout.parse(s, world, cfg)
    rows = []
    with cpu_backend():
        for n, (a_name, b_name) in enumerate(pairs):
            a, b = lay(a_name), lay(b_name)
            row = dict(world=world, src=str(a), dst=str(b))
            t = time.perf_counter()
            if cfg.is_moe:   # replicas of an expert are its edp ranks: load equal weights
                mol = build_on_layout(cfg, a, ddp=False, weights=reference_weights(cfg))
            else:
                mol = build_on_layout(cfg, a, ddp=False)
                _sync_replicas(mol)
            row["build_s"] = _maxed([time.perf_counter() - t])[0]
            ref = _sumsq(mol.module(), cfg, a, mol.coords)
            if not args.skip_megatron and not cfg.is_moe:   # its refit has no EP groups
                try:
                    m = _megatron_swap(mol, b, cfg)
                    m["ok"] = abs(m["sumsq"] - ref) <= 1e-9 * ref
                    for k in ("fixed_s", "first_s", "steady_s"):
                        m[k] = _maxed([m[k]])[0]
                    row["megatron"] = m
                except Exception as e:
                    row["megatron"] = dict(error=f"{type(e).__name__}: {str(e)[:160]}")
            # in-memory A -> B, then B -> A (the reverse pair, also reported)
            # first visit of B (its groups are created), back, then the steady state RL sees
            # (both layouts' groups cached) with each transport
            for key, dst, how in (("first", b, "auto"), ("first_back", a, "auto"),
                                  ("mem", b, "auto"), ("mem_back", a, "auto"),
                                  ("p2p", b, "p2p"), ("p2p_back", a, "p2p")):
                st = SwitchStats()
                dist.barrier()
                t, c = time.perf_counter(), _cpu()
                mol = switch_layout(mol, dst, bucket_bytes=args.bucket_mb << 20, stats=st,
                                    transport=how)
                cpu = _cpu() - c
                dist.barrier()
                wall = time.perf_counter() - t
                ok = abs(_sumsq(mol.module(), cfg, dst, mol.coords) - ref) \
                    <= 1e-9 * ref
                wall, plan_s, collect_s, rebuild_s, transfer_s = _maxed(
                    [wall, st.plan_s, st.collect_s, st.rebuild_s, st.transfer_s])
                sent, cpu = _summed([st.bytes_sent, cpu])
                row[key] = dict(wall_s=wall, cpu_s=cpu, plan_s=plan_s, collect_s=collect_s,
                                rebuild_s=rebuild_s, transfer_s=transfer_s, bytes_sent=int(sent),
                                bytes_moved=st.plan.bytes_moved, min_bytes=st.plan.min_bytes,
                                max_recv=max(st.plan.recv_bytes()), rounds=st.rounds, ok=ok,
                                transport=st.transport)
            # disk: A -> B through dist_checkpointing (a throwaway save first warms its workers)
            path = os.path.join(tmp_root, f"{world}_{n}")
            if n == 0:
                from earl_megatron.runtime.checkpoint import save_sharded
                os.makedirs(path + "_warm", exist_ok=True)
                dist.barrier()
                t = time.perf_counter()
                save_sharded(mol.module().sharded_state_dict(), path + "_warm")
                row["first_save_s"] = _maxed([time.perf_counter() - t])[0]
            st = SwitchStats()
            dist.barrier()
            t, c = time.perf_counter(), _cpu()
            mol = switch_via_checkpoint(mol, b, path, stats=st)
            cpu, = _summed([_cpu() - c])
            dist.barrier()
            wall = time.perf_counter() - t
            ok = abs(_sumsq(mol.module(), cfg, b, mol.coords) - ref) \
                <= 1e-9 * ref
            wall, save_s, rebuild_s, load_s = _maxed([wall, st.collect_s, st.rebuild_s,
                                                      st.transfer_s])
            row["disk"] = dict(wall_s=wall, cpu_s=cpu, save_s=save_s, rebuild_s=rebuild_s,
                               load_s=load_s,
                               bytes=_dir_bytes(path) if rank == 0 else 0, ok=ok)
            mol = None
            groups.destroy_groups()
            rows.append(row)
    return rows if rank == 0 else None


def _print(rows, weight_bytes):
    mb = 1 << 20
    print(f"\nmodel: {weight_bytes / mb:.0f} MiB of fp32 weights; times are the slowest rank's")
    print("first: the first switch into the layout (its groups are created; the process's first"
          " switch also maps the shared\n  outboxes); steady: both layouts' groups cached, as"
          " between RL stages; shm / p2p: transport; xfer = transfers only,\n  fixed = free +"
          " regroup + build + metadata; disk: dist_checkpointing save + rebuild + load (groups"
          " cached too);\n  disk/mem = whole-switch time ratio; mcore = swap_model_weights,"
          " first / steady")
    hdr = (f"{'world':>5} {'switch':<22} {'min MiB':>7} {'moved/min':>9} {'first s':>7} "
           f"{'shm xfer s':>10} {'fixed s':>7} {'shm s':>6} {'p2p xfer s':>10} {'p2p s':>6} "
           f"{'disk s':>6} {'disk/shm':>8} {'disk/p2p':>8} {'mcore 1st/steady s':>18}")
    print(hdr)
    for r in rows:
        there, back = f"{r['src']}->{r['dst']}", f"{r['dst']}->{r['src']}"
        for key, label in (("", there), ("_back", back)):
            f, m, p = r["first" + key], r["mem" + key], r["p2p" + key]
            ratio = m["bytes_moved"] / m["min_bytes"] if m["min_bytes"] else 1.0
            if not key:
                d = r["disk"]
                disk = f"{d['wall_s']:6.2f} {d['wall_s'] / m['wall_s']:8.1f} " \
                       f"{d['wall_s'] / p['wall_s']:8.1f}"
                mc = r.get("megatron", {})
                mcs = (f"{mc['first_s']:.2f}/{mc['steady_s']:.2f}" if "first_s" in mc
                       else "skipped" if not mc else "fails")
            else:
                disk, mcs = f"{'':6} {'':8} {'':8}", ""
            print(f"{r['world']:>5} {label:<22} {m['min_bytes'] / mb:7.1f} {ratio:9.2f} "
                  f"{f['wall_s']:7.2f} {m['transfer_s']:10.2f} {m['rebuild_s']:7.2f} "
                  f"{m['wall_s']:6.2f} {p['transfer_s']:10.2f} {p['wall_s']:6.2f} {disk} "
                  f"{mcs:>18}")
    print("\nCPU seconds summed over ranks (wall times on shared cores are noisy; CPU is not"
          " billed for waiting;\ndisk saves as the trainer does, runtime/checkpoint.save_sharded:"
          " no helper process):")
    for r in rows:
        f, m, p, d = r["first"], r["mem"], r["p2p"], r["disk"]
        print(f"  {r['world']} {r['src']}->{r['dst']}: in-memory first {f['cpu_s']:.2f}, steady "
              f"shm {m['cpu_s']:.2f}, p2p {p['cpu_s']:.2f}; disk {d['cpu_s']:.2f}; disk/shm "
              f"{d['cpu_s'] / max(m['cpu_s'], 1e-9):.1f}, disk/p2p "
              f"{d['cpu_s'] / max(p['cpu_s'], 1e-9):.1f}")
    print("\nchecks (sum of squares of all weights unchanged):")
    for r in rows:
        mc = r.get("megatron", {})
        mem_ok = all(r[k]["ok"] for k in ("first", "first_back", "mem", "mem_back", "p2p",
                                          "p2p_back"))
        print(f"  {r['world']} {r['src']}->{r['dst']}: in-memory (6 switches) {mem_ok}, disk {r['disk']['ok']} ({r['disk']['bytes'] / mb:.0f} MiB "
              f"written), megatron "
              f"{mc.get('ok', mc.get('error', 'skipped'))}"
              + (f" (fixed {mc['fixed_s']:.2f}s: grid groups + second model)" if "fixed_s" in mc
                 else ""))
    firsts = [r["first_save_s"] for r in rows if "first_save_s" in r]
    builds = ", ".join(f"{r['build_s']:.2f}s" for r in rows)
    warm = ", ".join(f"{x:.2f}s" for x in firsts)
    print(f"  build of a model on its first layout: {builds}; first dist_checkpointing save in "
          f"a process (warm-up, not counted): {warm}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--group-cache", type=int, default=4,
                   help="layouts whose groups stay cached (runtime/groups.py); the steady "
                        "switches need both of a pair's")
    p.add_argument("--experts", type=int, default=0,
                   help="a qwen3_moe model with this many experts per layer (expert width "
                        "ffn / 2, top 2) and the EP layout pairs; 0: the dense Llama")
    p.add_argument("--skip-megatron", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)

    from earl_megatron.plan.tensor_table import num_parameters
    from earl_megatron.testing.multiproc import run_distributed

    cfg = _cfg(args)
    weight_bytes = 4 * num_parameters(cfg)
    rows = []
    tmp_root = tempfile.mkdtemp(prefix="reshard_bench_")
    try:
        for world in args.worlds:
            t = time.time()
            pairs = (MOE_PAIRS if args.experts else PAIRS)[world]
            rows += run_distributed(_job, world, pairs, vars(args), tmp_root,
                                    timeout=args.timeout, collective_timeout_s=600)[0]
            print(f"[world {world}: {time.time() - t:.0f}s including process start]",
                  file=sys.stderr)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    print(f"group cache: {args.group_cache} layouts")
    _print(rows, weight_bytes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
