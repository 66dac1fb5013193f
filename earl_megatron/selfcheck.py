"""Layout self-check: train the tiny model a few steps on every valid layout of this world.

    torchrun --standalone --nproc-per-node 4 -m earl_megatron.selfcheck

For each layout (in one job: groups are rebuilt in place) it builds Megatron-Core's GPTModel,
loads the same reference weights, runs ``--steps`` optimizer steps on the same data and prints
the loss after each and the mean step time. Every layout must print the same losses (to ~1e-6):
that is the check. Exit status 1 if any layout disagrees with the first by more than 1e-4.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist

from earl_megatron.config.model import FAMILIES, ModelConfig
from earl_megatron.plan.layout import enumerate_layouts
from earl_megatron.plan.tensor_table import num_parameters
from earl_megatron.runtime import groups
from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
from earl_megatron.runtime.cpu_backend import cpu_backend
from earl_megatron.runtime.dist import init_distributed, shutdown
from earl_megatron.runtime.step import local_microbatches, random_batch, train_step
from earl_megatron.models.sharding import reference_weights


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--family", default="llama", choices=FAMILIES)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = init_distributed()
    cfg = ModelConfig.tiny(args.family)
    weights = reference_weights(cfg, seed=0)
    batches = [random_batch(args.global_batch, args.seq_len, cfg.vocab_size, seed=s)
               for s in range(args.steps)]
    rows = []
    backend = cpu_backend() if not torch.cuda.is_available() else contextlib.nullcontext()
    with backend:
        for lay in enumerate_layouts(world, cfg):
            if args.global_batch % lay.dp:
                continue
            on_layout = build_on_layout(cfg, lay, weights=weights, optimizer=OptimizerSpec(lr=1e-3))
            losses, times = [], []
            for b in batches:
                mbs = local_microbatches(b, lay, on_layout.coords, micro_batch_size=1)
                r = train_step(on_layout, mbs, seq_len=args.seq_len, micro_batch_size=1)
                losses.append(r.loss)
                times.append(r.seconds)
            groups.destroy_groups()
            step_ms = 1000 * sum(times[1:] or times) / len(times[1:] or times)
            rows.append((str(lay), losses, step_ms))
    ok = True
    if rank == 0:
        ref = rows[0][1]
        _print_table(rows, ref, world, cfg)
        worst = max(max(abs(a - b) for a, b in zip(l, ref)) for _, l, _ in rows)
        ok = worst < 1e-4
        print(f"{len(rows)} layouts on {world} ranks; max loss difference to {rows[0][0]}: "
              f"{worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    flag = torch.tensor([0 if ok else 1])
    dist.broadcast(flag, 0)
    shutdown()
    return int(flag.item())


def _print_table(rows, ref, world, cfg) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a dependency, but the check must not depend on pretty output
        for name, losses, ms in rows:
            print(f"{name:16s} " + " ".join(f"{x:.6f}" for x in losses) + f"  {ms:7.1f} ms/step")
        return
    t = Table(title=f"tiny {cfg.family} ({num_parameters(cfg) / 1e6:.2f}M params), {world} ranks")
    t.add_column("layout")
    for i in range(len(ref)):
        t.add_column(f"loss step {i}", justify="right")
    t.add_column("ms/step", justify="right")
    for name, losses, ms in rows:
        t.add_row(name, *[f"{x:.6f}" for x in losses], f"{ms:.1f}")
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
