"""Dry run of the layout selector: the layout each stage would get across contexts and loads.

No devices are touched; this only evaluates the memory and time models (and a profile table when
given). Example, the paper's setting (Qwen2.5-72B on 16 nodes of 8 H100-80GB, 200 Gbps)::

    python tools/plan_layouts.py --model qwen2.5-72b --nodes 16 --gpus-per-node 8 \\
        --gpu-mem-gb 80 --inter-node-gbps 200 --png plan.png

For every stage it prints a table: one row per context length, one column per number of
responses in flight (ROLLOUT: responses decoding at once; LOGPROB and TRAIN: sequences in the
batch). A cell holds the chosen layout and how many valid layouts would run out of memory
("12/90 OOM"); "OOM" alone means none fits. Within a cell the stages are planned in order
(rollout -> logprob -> train), each costed with the switch from the previous one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.presets import PRESETS, get_preset
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.selector import (LayoutPlan, NoLayoutFitsError, Selector, SelectorConfig,
                                         SelectorState)
from earl_megatron.plan.specs import (ClusterSpec, Recompute, Stage, StageWorkload, TrainOptions,
                                     human_bytes)
from earl_megatron.plan.tensor_table import num_parameters

DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_LOADS = (8, 16, 32, 64, 128)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, optionally overridden field by field)")
    m.add_argument("--model", default="qwen2.5-72b",
                   help=f"preset name: {', '.join(sorted(PRESETS))}")
    for flag, field in [("--layers", "num_layers"), ("--hidden", "hidden_size"),
                        ("--ffn", "ffn_hidden_size"), ("--heads", "num_attention_heads"),
                        ("--kv-heads", "num_query_groups"), ("--vocab", "vocab_size")]:
        m.add_argument(flag, dest=field, type=int, help=f"override {field}")
    m.add_argument("--tie-embeddings", action="store_true", default=None)
    c = p.add_argument_group("cluster (H100-80GB SXM defaults)")
    c.add_argument("--cluster", choices=("h100", "cpu"), default="h100")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu-mem-gb", type=float, help="memory per device in GB (1e9 bytes)")
    c.add_argument("--inter-node-gbps", type=float, default=200.0,
                   help="network bandwidth per node, Gbit/s")
    c.add_argument("--intra-node-gbps", type=float, help="device-to-device GB/s within a node")
    c.add_argument("--gpu-tflops", type=float, help="dense bf16 TFLOP/s per device")
    w = p.add_argument_group("workload and options")
    w.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS,
                   help="comma-separated context lengths in tokens")
    w.add_argument("--in-flight", type=_ints, default=DEFAULT_LOADS,
                   help="comma-separated responses in flight / sequences per batch")
    w.add_argument("--stages", default="rollout,logprob,train")
    w.add_argument("--micro-batch-tokens", type=int, default=8192)
    w.add_argument("--recompute", choices=[r.value for r in Recompute], default="none")
    w.add_argument("--no-distributed-optimizer", action="store_true")
    w.add_argument("--margin", type=float, default=0.1, help="memory safety margin (fraction)")
    w.add_argument("--max-tp", type=int)
    w.add_argument("--profile", help="profile table JSON (from tools/profile_layouts.py)")
    p.add_argument("--png", help="write a heatmap of the chosen layouts to this PNG file")
    return p


def model_from_args(args) -> ModelConfig:
    model = get_preset(args.model)
    changes = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                             "num_attention_heads", "num_query_groups",
                                             "vocab_size") if getattr(args, k) is not None}
    if args.tie_embeddings:
        changes["tie_word_embeddings"] = True
    return model.with_(**changes) if changes else model


def cluster_from_args(args) -> ClusterSpec:
    if args.cluster == "cpu":
        cl = ClusterSpec.cpu(ranks=args.nodes * args.gpus_per_node)
    else:
        cl = ClusterSpec.h100_80gb(nodes=args.nodes, inter_node_gbps=args.inter_node_gbps)
        cl = cl.with_(devices_per_node=args.gpus_per_node,
                      name=f"{args.nodes}x{args.gpus_per_node} H100, "
                           f"{args.inter_node_gbps:g} Gbps")
    if args.gpu_mem_gb:
        cl = cl.with_(device_memory_bytes=int(args.gpu_mem_gb * 1e9))
    if args.intra_node_gbps:
        cl = cl.with_(intra_node_bandwidth=args.intra_node_gbps * 1e9)
    if args.gpu_tflops:
        cl = cl.with_(peak_flops=args.gpu_tflops * 1e12)
    return cl


Grid = dict[tuple[Stage, int, int], "LayoutPlan | NoLayoutFitsError"]


def plan_grid(selector: Selector, stages: Sequence[Stage], contexts: Sequence[int],
              loads: Sequence[int], micro_batch_tokens: int) -> Grid:
    """The plan (or the NoLayoutFitsError) of every (stage, context, load) cell."""
    grid: Grid = {}
    for ctx in contexts:
        for load in loads:
            current, state = None, SelectorState()
            for stage in stages:
                wl = StageWorkload.of(stage, ctx, load, responses_in_flight=load,
                                      micro_batch_tokens=micro_batch_tokens)
                try:
                    plan, state = selector.plan(wl, current=current, state=state)
                    current = plan.layout
                    grid[(stage, ctx, load)] = plan
                except NoLayoutFitsError as e:
                    grid[(stage, ctx, load)] = e
    return grid


def cell_text(result) -> str:
    if isinstance(result, NoLayoutFitsError):
        return "OOM"
    return f"{result.layout} {len(result.oom)}/{result.num_valid} OOM"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def print_tables(grid: Grid, stages, contexts, loads, header: str, out=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(file=out or sys.stdout, width=max(160, 40 + 26 * len(loads)),
                      no_color=True)
    console.print(header)
    for stage in stages:
        table = Table(title=f"{stage.value}: chosen layout (OOM = no layout fits)")
        table.add_column("context")
        for load in loads:
            table.add_column(f"{load} in flight")
        for ctx in contexts:
            table.add_row(_k(ctx), *(cell_text(grid[(stage, ctx, ld)]) for ld in loads))
        console.print(table)
        for ctx in contexts:
            errs = [grid[(stage, ctx, ld)] for ld in loads
                    if isinstance(grid[(stage, ctx, ld)], NoLayoutFitsError)]
            if errs:
                console.print(f"  {stage.value} {_k(ctx)}: would fit with "
                              f"{'; '.join(errs[-1].suggestions) or 'nothing tried'}")


def write_png(grid: Grid, stages, contexts, loads, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    names = sorted({str(r.layout) for r in grid.values() if isinstance(r, LayoutPlan)})
    index = {n: i + 1 for i, n in enumerate(names)}          # 0 = OOM
    colours = ["#444444"] + [plt.get_cmap("tab20")(i % 20) for i in range(len(names))]
    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 0.5 * len(contexts) + 2),
                             squeeze=False)
    for ax, stage in zip(axes[0], stages):
        data = [[0 if isinstance(grid[(stage, c, ld)], NoLayoutFitsError)
                 else index[str(grid[(stage, c, ld)].layout)] for ld in loads] for c in contexts]
        ax.imshow(data, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1,
                  aspect="auto", origin="lower")
        for i, c in enumerate(contexts):
            for j, ld in enumerate(loads):
                r = grid[(stage, c, ld)]
                ax.text(j, i, "OOM" if isinstance(r, NoLayoutFitsError) else str(r.layout),
                        ha="center", va="center", fontsize=6, color="white")
        ax.set_xticks(range(len(loads)), [str(ld) for ld in loads])
        ax.set_yticks(range(len(contexts)), [_k(c) for c in contexts])
        ax.set_xlabel("responses in flight")
        ax.set_ylabel("context length")
        ax.set_title(stage.value)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None, out=None) -> int:
    args = build_parser().parse_args(argv)
    model = model_from_args(args)
    cluster = cluster_from_args(args)
    opts = TrainOptions(recompute=Recompute(args.recompute),
                        distributed_optimizer=not args.no_distributed_optimizer)
    profile = ProfileTable.load(args.profile) if args.profile else None
    selector = Selector(model, cluster, opts,
                        SelectorConfig(memory_margin=args.margin, max_tp=args.max_tp), profile)
    stages = [Stage(s.strip()) for s in args.stages.split(",") if s.strip()]
    grid = plan_grid(selector, stages, args.contexts, args.in_flight, args.micro_batch_tokens)
    n = num_parameters(model)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    header = (f"{args.model}: {size} parameters on {cluster.name} "
              f"({cluster.world_size} devices, budget {human_bytes(selector.budget_bytes)} per "
              f"rank after a {args.margin:.0%} margin); recompute={args.recompute}, "
              f"micro-batch {args.micro_batch_tokens} tokens")
    print_tables(grid, stages, args.contexts, args.in_flight, header, out)
    if args.png:
        write_png(grid, stages, args.contexts, args.in_flight, args.png, header)
        print(f"wrote {args.png}", file=out or sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
