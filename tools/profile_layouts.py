"""Measure TRAIN, LOGPROB and ROLLOUT step times of every layout on this machine; write a ProfileTable.

    torchrun --standalone --nproc-per-node 4 tools/profile_layouts.py --out profile.json \\
        --contexts 128,256,512 --stages train,logprob

For every valid layout of the world (``enumerate_layouts``; ``--layouts`` narrows it), every
context bucket and every load (sequences per global batch), all ranks build Megatron-Core's
GPTModel on the layout (in one job: groups are rebuilt in place), run ``--warmup`` untimed steps,
then time ``--repeats`` steps:

- train:   ``train_step`` (zero grads, forward/backward over Megatron's schedule, Adam step);
- logprob: ``forward_backward(forward_only=True)`` under ``torch.no_grad()``;
- rollout: the embedded engine's ``generate`` of ``load`` prompts of ``(1 - decode_fraction) x
  context`` random tokens, sampling ``decode_fraction x context`` new tokens each at T = 1
  (``StageWorkload``'s default fraction; layouts with cp = 1 only): the engine constants of the
  rollout cost model (``DecodeEngine``) are calibrated by these entries.

A step's time is wall-clock from a barrier before it to a barrier after it, the maximum over
ranks, so every rank records the same number. ``--rounds`` > 1 repeats the whole sweep over the
layouts, so that a drift in the machine's load spreads over all layouts instead of biasing the
ones measured last. The table entry is the median of all timed steps of the point, recorded as
``ProfileTable.record(stage, layout, context_bucket=context, load=sequences, seconds=median)``;
rank 0 writes the JSON and prints a table (milliseconds).

The workload a point stands for, in the selector's terms, is ``StageWorkload.of(stage, context,
load, micro_batch_tokens=context * micro_batch_size)``: each micro-batch holds
``--micro-batch-size`` whole sequences (meta ``micro_batch_size`` in the file).

Layouts that cannot run a point are skipped and listed: ``load`` must divide by dp (and the
per-replica batch by the micro-batch size), ``context`` by 2*cp (the load-balanced CP split).
The model is ``ModelConfig.tiny(--family)`` unless overridden field by field.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from earl_megatron.config.model import FAMILIES, ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.specs import Stage, StageWorkload
from earl_megatron.plan.tensor_table import num_parameters

MEASURED_STAGES = (Stage.TRAIN, Stage.LOGPROB, Stage.ROLLOUT)
DEFAULT_STAGES = (Stage.TRAIN, Stage.LOGPROB)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _stages(text: str) -> tuple[Stage, ...]:
    names = {s.value: s for s in MEASURED_STAGES}
    out = []
    for name in (x.strip().lower() for x in text.split(",") if x.strip()):
        if name not in names:
            raise argparse.ArgumentTypeError(
                f"stage {name!r} is not measured by this tool; choose from {sorted(names)}")
        out.append(names[name])
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="ProfileTable JSON to write (rank 0)")
    p.add_argument("--contexts", type=_ints, default=(128, 256, 512),
                   help="comma-separated context lengths (tokens per sequence)")
    p.add_argument("--loads", type=_ints, default=(4,),
                   help="comma-separated sequences per global batch")
    p.add_argument("--stages", type=_stages, default=DEFAULT_STAGES,
                   help="comma-separated: train, logprob")
    p.add_argument("--layouts", help="comma-separated layouts to measure, e.g. 'tp2-pp2,dp4' "
                   "(default: every valid layout)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per point")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point and round")
    p.add_argument("--rounds", type=int, default=1, help="sweeps over all layouts")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="plain Adam (default: Megatron's distributed optimizer, as "
                   "TrainOptions() assumes)")
    p.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model: ModelConfig.tiny(family) with optional overrides")
    m.add_argument("--family", choices=FAMILIES, default="llama")
    for flag, field in [("--layers", "num_layers"), ("--hidden", "hidden_size"),
                        ("--ffn", "ffn_hidden_size"), ("--heads", "num_attention_heads"),
                        ("--kv-heads", "num_query_groups"), ("--vocab", "vocab_size")]:
        m.add_argument(flag, dest=field, type=int, help=f"override {field}")
    m.add_argument("--tie-embeddings", action="store_true")
    return p


def model_from_args(args) -> ModelConfig:
    changes = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                             "num_attention_heads", "num_query_groups",
                                             "vocab_size") if getattr(args, k) is not None}
    return ModelConfig.tiny(args.family, tie_word_embeddings=args.tie_embeddings, **changes)


@dataclass(frozen=True)
class Point:
    stage: Stage
    layout: ParallelLayout
    context: int
    load: int


def skip_reason(layout: ParallelLayout, context: int, load: int,
                micro_batch_size: int, stage: Optional[Stage] = None) -> Optional[str]:
    """Why ``layout`` cannot run ``load`` sequences of ``context`` tokens (None if it can)."""
    if stage is Stage.ROLLOUT:
        return f"cp={layout.cp}: the rollout engine decodes with cp=1" if layout.cp > 1 \
            else None
    if load % layout.dp:
        return f"load {load} does not divide by dp={layout.dp}"
    if (load // layout.dp) % micro_batch_size:
        return f"{load // layout.dp} sequences per replica do not divide by micro-batch size " \
               f"{micro_batch_size}"
    if layout.cp > 1 and context % (2 * layout.cp):
        return f"context {context} does not divide by 2*cp={2 * layout.cp}"
    return None


def _timed(fn: Callable[[], object]) -> float:
    """Barrier-to-barrier seconds of ``fn()``, the maximum over ranks."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_layouts(cfg: ModelConfig, layouts: Sequence[ParallelLayout],
                    contexts: Sequence[int], loads: Sequence[int], stages: Sequence[Stage], *,
                    warmup: int = 1, repeats: int = 3, rounds: int = 1,
                    micro_batch_size: int = 1, distributed_optimizer: bool = True,
                    seed: int = 0, log: Optional[Callable[[str], None]] = None
                    ) -> tuple[dict[Point, list[float]], list[str]]:
    """Collective over the world: timed seconds per point, and the skipped points' reasons.

    Must run with torch.distributed initialised (and inside ``cpu_backend()`` on CPU)."""
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.step import local_microbatches, random_batch

    if warmup < 0 or repeats < 1 or rounds < 1:
        raise ValueError(f"need warmup >= 0, repeats >= 1, rounds >= 1; got {warmup}, "
                         f"{repeats}, {rounds}")
    batches = {(ctx, load): random_batch(load, ctx, cfg.vocab_size, seed=seed + ctx + load)
               for ctx in contexts for load in loads}
    samples: dict[Point, list[float]] = {}
    skipped: list[str] = []
    for rnd in range(rounds):
        for lay in layouts:
            runnable = []
            for ctx in contexts:
                for load in loads:
                    todo = []
                    for stage in stages:
                        why = skip_reason(lay, ctx, load, micro_batch_size, stage)
                        if why is None:
                            todo.append(stage)
                        elif rnd == 0:
                            skipped.append(f"{stage.value} {lay} context {ctx} load {load}: "
                                           f"{why}")
                    if todo:
                        runnable.append((ctx, load, todo))
            if not runnable:
                continue
            t0 = time.perf_counter()
            mol = build_on_layout(cfg, lay, seed=seed + 1234, optimizer=OptimizerSpec(
                use_distributed_optimizer=distributed_optimizer))
            for ctx, load, todo in runnable:
                mbs = None if todo == [Stage.ROLLOUT] else \
                    local_microbatches(batches[(ctx, load)], lay, mol.coords, micro_batch_size)
                for stage in todo:
                    step = _step(stage, mol, mbs, lay, ctx, load, micro_batch_size, seed)
                    for _ in range(warmup):
                        _timed(step)
                    times = [_timed(step) for _ in range(repeats)]
                    samples.setdefault(Point(stage, lay, ctx, load), []).extend(times)
            groups.destroy_groups()
            if log is not None:
                log(f"round {rnd + 1}/{rounds} {lay}: {len(runnable)} points in "
                    f"{time.perf_counter() - t0:.1f} s")
    return samples, skipped


def _step(stage: Stage, mol, mbs, lay: ParallelLayout, ctx: int, load: int,
          micro_batch_size: int, seed: int) -> Callable[[], object]:
    """One timed step of ``stage`` (module docstring)."""
    import math

    import torch

    from earl_megatron.runtime.step import forward_backward, train_step

    if stage is Stage.TRAIN:
        return lambda: train_step(mol, mbs, seq_len=ctx, micro_batch_size=micro_batch_size)
    if stage is Stage.LOGPROB:
        def step():
            with torch.no_grad():
                forward_backward(mol.model, mol.tcfg, mbs, lay, seq_len=ctx,
                                 micro_batch_size=micro_batch_size, forward_only=True)
        return step
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.engine import SamplingParams

    new = max(1, math.ceil(StageWorkload.decode_fraction * ctx))
    g = torch.Generator().manual_seed(seed + ctx + load)
    prompts = torch.randint(0, mol.cfg.vocab_size, (load, max(1, ctx - new)),
                            generator=g).tolist()
    engine = EmbeddedEngine(mol)
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=seed)
    return lambda: engine.generate(prompts, params)


def to_table(samples: dict[Point, list[float]], **meta: str) -> ProfileTable:
    """The median of every point's samples as a ProfileTable."""
    table = ProfileTable().with_meta(**meta)
    for p, times in sorted(samples.items(), key=lambda kv: (kv[0].stage.value, kv[0].layout,
                                                             kv[0].context, kv[0].load)):
        table = table.record(p.stage, p.layout, context_bucket=p.context, load=p.load,
                             seconds=statistics.median(times))
    return table


def format_table(table: ProfileTable) -> str:
    """Milliseconds per layout (rows) and (stage, context, load) (columns); '-' = not run."""
    cols = sorted({(e.stage, e.context_bucket, e.load) for e in table.entries})
    layouts = sorted({e.layout for e in table.entries})
    ms = {(e.stage, e.layout, e.context_bucket, e.load): 1000 * e.seconds for e in table.entries}
    heads = [f"{s}@{c}x{n}" for s, c, n in cols]
    width = max([10] + [len(h) for h in heads])
    lines = ["layout      " + " ".join(h.rjust(width) for h in heads)]
    for lay in layouts:
        cells = [f"{ms[(s, lay, c, n)]:.1f}" if (s, lay, c, n) in ms else "-" for s, c, n in cols]
        lines.append(f"{str(lay):11s} " + " ".join(x.rjust(width) for x in cells))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.dist import init_distributed, shutdown

    torch.set_num_threads(1)
    cfg = model_from_args(args)
    rank, world = init_distributed()
    layouts = enumerate_layouts(world, cfg)
    if args.layouts:
        layouts = [ParallelLayout.parse(x, world_size=world, model=cfg)
                   for x in args.layouts.split(",") if x.strip()]
    log = (lambda s: print(s, flush=True)) if rank == 0 else None
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    t0 = time.perf_counter()
    backend = cpu_backend() if not torch.cuda.is_available() else contextlib.nullcontext()
    with backend:
        samples, skipped = measure_layouts(
            cfg, layouts, args.contexts, args.loads, args.stages, warmup=args.warmup,
            repeats=args.repeats, rounds=args.rounds, micro_batch_size=args.micro_batch_size,
            distributed_optimizer=not args.no_distributed_optimizer, seed=args.seed, log=log)
    if rank == 0:
        import megatron.core

        table = to_table(
            samples, tool="tools/profile_layouts.py", world_size=str(world),
            device="cuda" if torch.cuda.is_available() else "cpu", model=repr(cfg),
            micro_batch_size=str(args.micro_batch_size),
            distributed_optimizer=str(not args.no_distributed_optimizer),
            warmup=str(args.warmup), repeats=str(args.repeats), rounds=str(args.rounds),
            statistic="median of barrier-to-barrier seconds, max over ranks",
            load_average_at_start=f"{load_avg:.2f}", cpu_count=str(os.cpu_count()),
            torch=torch.__version__, megatron_core=megatron.core.__version__,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        table.save(args.out)
        print(f"{cfg.family} {num_parameters(cfg):,} params, {world} ranks, "
              f"{len(table.entries)} points in {time.perf_counter() - t0:.0f} s "
              f"(load average at start {load_avg:.1f}); milliseconds per step:")
        print(format_table(table))
        for line in skipped:
            print(f"skipped {line}")
        print(f"wrote {args.out}")
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
