"""Dry run of the layout selector: the layout each stage would get across contexts and loads.

No devices are touched; this only evaluates the memory and time models (and a profile table when
given). Example, the paper's setting (Qwen2.5-72B on 16 nodes of 8 H100-80GB, 200 Gbps)::

    python tools/plan_layouts.py --model qwen2.5-72b --nodes 16 --gpus-per-node 8 \\
        --gpu-mem-gb 80 --inter-node-gbps 200 --png plan.png

For every stage it prints a table: one row per context length, one column per number of
responses (``--responses``: in the grid, sequences of the iteration IN TOTAL over all dp
replicas, and for ROLLOUT also the responses submitted at once; each rollout replica gets its
share). A cell holds the chosen layout, its predicted seconds and memory per rank, and the
runner-up with its margin; the legend under each table explains the cell and lists which
layouts ran out of memory. "OOM" alone means none fits. Within a cell the stages are planned in
order (rollout -> logprob -> train), each costed with the switch from the previous one.

A mixture-of-experts preset (``--model qwen3-30b-a3b``) plans every expert-parallel size too
(``EP4xTP2xDP4``; ``ETP1``: experts not tensor-split); each plan's reason says what its EP
holds per rank, what the token all-to-all costs, and what the same layout at EP1 would need.

``--lora-rank R`` (with ``--lora-targets``, default all four linears) plans a LoRA run of the
model: the frozen base holds no gradient or optimizer state (plan/lora_memory.py). The tables
are the LoRA model's; under them a TRAIN table per context compares the full fine-tune with
LoRA: the layout each gets on this cluster, and the fewest devices (1, 2, 4, ... within a node,
then whole nodes) on which TRAIN fits at all (docs/lora.md).

``--critic`` plans PPO's run (``algorithm=ppo``, issue #45): a critic of the policy's shape
trains beside it, and its weights, grads and Adam state stay resident beside every stage, counted
as the trainer counts them (plan/critic_memory.py, the functions trainer/planner.py calls). The
tables are the policy's stages with the critic's state resident as the trainer counts it under
auto: the critic trains where the policy trains and moves with it, so TRAIN counts it in each
candidate's own layout and the other stages in the cell's TRAIN layout (``critic_layout``);
under them a TRAIN table per context: the policy without and with the critic, the critic's
layout (the TRAIN layout) and its own TRAIN there, the fewest devices on which TRAIN fits
without and with it, and the memory rows of both (docs/algorithms.md).

``--compare tp4,tp8`` instead prices the named layouts side by side for one stage (``--stage``):
for ROLLOUT, ``--responses`` then counts responses PER ROLLOUT REPLICA (as engine benchmarks and
the EARL paper do: a TP4 layout runs twice the replicas of a TP8 one, so twice the responses),
and the figure of merit is generated tokens per GPU-second. ``--json OUT.json`` writes one
object per (context, responses, layout): context, responses, layout, fits, tokens_per_gpu_s
(null when it does not fit), memory_bytes, seconds, running_batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from earl_megatron.config.checks import ConfigError
from earl_megatron.config.lora import TARGETS, LoraSpec
from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.critic_memory import (beside_critic, critic_model,
                                              critic_selector, held_bytes)
from earl_megatron.plan.presets import PRESETS, get_preset
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.selector import (LayoutPlan, NoLayoutFitsError, Selector, SelectorConfig,
                                         SelectorState)
from earl_megatron.plan.specs import (CLUSTER_PRESETS, ClusterSpec, DecodeEngine, Recompute,
                                      Stage, StageWorkload, TrainOptions, cluster_spec,
                                      human_bytes)
from earl_megatron.plan.split import SplitDoesNotFitError, SplitWorkload, plan_split
from earl_megatron.plan.time_model import decode_tokens, rollout_running_batch
from earl_megatron.plan.tensor_table import num_parameters, tensor_table

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
    m.add_argument("--lora-rank", type=int, default=0,
                   help="plan a LoRA run with adapters of this rank (the trainer's "
                        "model.lora.rank): only the adapters train; 0: a full fine-tune")
    m.add_argument("--lora-targets", help="comma-separated linears the adapters wrap (any of "
                   f"{','.join(TARGETS)}; default all; model.lora.targets)")
    c = p.add_argument_group("cluster (H100-80GB SXM defaults)")
    c.add_argument("--cluster", choices=CLUSTER_PRESETS, default="h100")
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
    w.add_argument("--responses", "--in-flight", dest="in_flight", type=_ints,
                   default=DEFAULT_LOADS,
                   help="comma-separated counts. Grid: sequences per iteration IN TOTAL over all "
                        "dp replicas (ROLLOUT: responses submitted at once, split over the "
                        "replicas). --compare with --stage rollout: responses PER ROLLOUT "
                        "REPLICA (each replica of each layout runs this many)")
    w.add_argument("--stages", "--stage", dest="stages", default="rollout,logprob,train",
                   help="comma-separated stages (rollout, logprob, train)")
    w.add_argument("--decode-fraction", type=float,
                   help="ROLLOUT: fraction of each context generated (the rest is prefilled); "
                        f"default {StageWorkload.decode_fraction}")
    w.add_argument("--compare", help="comma-separated layouts (e.g. tp4,tp8) priced side by side "
                                     "for each --stage instead of the grid")
    w.add_argument("--json", help="with --compare: write the rows to this JSON file")
    w.add_argument("--micro-batch-tokens", type=int, default=8192)
    w.add_argument("--critic", action="store_true",
                   help="plan algorithm=ppo: the critic's train state resident beside every "
                        "stage, its own layout and memory, and the fewest devices with it")
    w.add_argument("--recompute", choices=["auto"] + [r.value for r in Recompute],
                   default="auto", help="TRAIN activation recomputation; auto: the selector "
                   "picks it per cell with the layout (the trainer's layout.recompute=auto)")
    w.add_argument("--no-distributed-optimizer", action="store_true")
    w.add_argument("--margin", type=float, default=0.1, help="memory safety margin (fraction)")
    w.add_argument("--max-tp", type=int)
    w.add_argument("--profile", help="profile table JSON (from tools/profile_layouts.py)")
    sp = p.add_argument_group("split placement (plan/split.py)")
    sp.add_argument("--split", help="auto: the split the selector picks (colocated or a rollout "
                    "pool of whole nodes) per context, against colocated; N: that many rollout "
                    "ranks. One row per (context, --responses), the iteration's batch")
    sp.add_argument("--env-seconds", type=float, default=0.0,
                    help="--split: seconds the environments add to a rollout (tools, opponents)")
    sp.add_argument("--sglang-mem-fraction", type=float,
                    help="ROLLOUT on SGLang servers started with this --mem-fraction-static (the "
                         "trainer's rollout.engine=sglang; recipes: 0.8 on cuda)")
    p.add_argument("--reasons", action="store_true",
                   help="under each table, print every cell's plan reason (the selector's words)")
    p.add_argument("--png", help="write a heatmap of the chosen layouts to this PNG file")
    return p


def model_from_args(args) -> ModelConfig:
    model = get_preset(args.model)
    changes = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                             "num_attention_heads", "num_query_groups",
                                             "vocab_size") if getattr(args, k) is not None}
    if args.tie_embeddings:
        changes["tie_word_embeddings"] = True
    if args.lora_targets and not args.lora_rank:
        raise SystemExit("--lora-targets needs --lora-rank R (R >= 1): without a rank every "
                         "parameter trains")
    if args.lora_rank:
        targets = tuple(x.strip() for x in args.lora_targets.split(",") if x.strip()) \
            if args.lora_targets else TARGETS
        try:
            changes["lora"] = LoraSpec(rank=args.lora_rank, targets=targets)
            return model.with_(**changes)
        except ConfigError as e:
            raise SystemExit(f"--lora-rank {args.lora_rank} --lora-targets "
                             f"{','.join(targets)}: {e}") from None
    return model.with_(**changes) if changes else model


def cluster_from_args(args) -> ClusterSpec:
    """The trainer's mapping (plan/specs.py cluster_spec), plus this tool's extra rate flags."""
    cl = cluster_spec(args.cluster, nodes=args.nodes, devices_per_node=args.gpus_per_node,
                      inter_node_gbps=args.inter_node_gbps,
                      device_memory_bytes=int(args.gpu_mem_gb * 1e9) if args.gpu_mem_gb else None)
    if args.intra_node_gbps:
        cl = cl.with_(intra_node_bandwidth=args.intra_node_gbps * 1e9)
    if args.gpu_tflops:
        cl = cl.with_(peak_flops=args.gpu_tflops * 1e12)
    return cl


Grid = dict[tuple[Stage, int, int], "LayoutPlan | NoLayoutFitsError"]


def _workload(stage: Stage, ctx: int, sequences: int, micro_batch_tokens: int,
              decode_fraction: Optional[float]) -> StageWorkload:
    extra = {} if decode_fraction is None else {"decode_fraction": decode_fraction}
    return StageWorkload.of(stage, ctx, sequences, responses_in_flight=sequences,
                            micro_batch_tokens=micro_batch_tokens, **extra)


def plan_grid(selector: Selector, stages: Sequence[Stage], contexts: Sequence[int],
              loads: Sequence[int], micro_batch_tokens: int,
              decode_fraction: Optional[float] = None, critic: bool = False) -> Grid:
    """The plan (or the NoLayoutFitsError) of every (stage, context, load) cell. ``critic``:
    each cell's stages with the critic's train state resident as the trainer counts it
    (``critic_layout``; every stage OOM when TRAIN fits nowhere beside it)."""
    grid: Grid = {}
    for ctx in contexts:
        for load in loads:
            current, state, resident, train_sel = None, SelectorState(), 0, selector
            if critic:
                train_sel = beside_critic(selector)
                try:
                    resident = held_bytes(critic_model(selector.model), critic_layout(
                        selector, _workload(Stage.TRAIN, ctx, load, micro_batch_tokens,
                                            decode_fraction)), selector.train_opts)
                except NoLayoutFitsError as e:
                    grid.update({(stage, ctx, load): e for stage in stages})
                    continue
            for stage in stages:
                wl = _workload(stage, ctx, load, micro_batch_tokens, decode_fraction)
                try:
                    plan, state = (train_sel if stage is Stage.TRAIN else selector).plan(
                        wl, current=current, state=state,
                        resident_bytes=0 if stage is Stage.TRAIN else resident)
                    current = plan.layout
                    grid[(stage, ctx, load)] = plan
                except NoLayoutFitsError as e:
                    grid[(stage, ctx, load)] = e
    return grid


def critic_layout(selector: Selector, train: StageWorkload) -> ParallelLayout:
    """Where the trainer's critic is for a batch of TRAIN workload ``train`` under auto: the
    batch's TRAIN layout, planned with the critic's train state in each candidate's own layout
    (trainer/planner.py); NoLayoutFitsError when none fits."""
    return beside_critic(selector).plan(train)[0].layout


def critic_memory(selector: Selector, layout: ParallelLayout, train: StageWorkload,
                  resident: int):
    """The critic's own TRAIN of ``train`` in ``layout`` beside ``resident`` bytes (the
    policy's train state): the estimate of the first recompute mode that fits, else of the
    last (the smallest; it does not fit)."""
    sel = critic_selector(selector)
    mems = [sel.memory(layout, train, resident, rc) for rc in sel.recompute_modes(Stage.TRAIN)]
    return next((m for m in mems if sel.fits(m)), mems[-1])


def cell_text(result) -> str:
    """"TP8xDP16 12.3s 61G | TP4xDP32 +4%": chosen layout, seconds, GiB per rank, runner-up."""
    if isinstance(result, NoLayoutFitsError):
        return "OOM"
    c = result.chosen
    text = f"{_choice(c)} {_seconds(c.predicted_seconds)} {c.memory.total / 2**30:.0f}G"
    if result.runner_up is not None:
        margin = result.runner_up.cost / c.cost - 1 if c.cost > 0 else 0.0
        text += f" | {_choice(result.runner_up)} {margin:+.1%}"
    return text


def _choice(candidate) -> str:
    """A candidate's layout, and its recompute mode when it recomputes ("TP2xPP8 full")."""
    rc = candidate.recompute
    return str(candidate.layout) + ("" if rc is Recompute.NONE else f" {rc.value}")


def _seconds(x: float) -> str:
    return f"{x:.3g}s" if x >= 0.01 else f"{1e3 * x:.2g}ms"


LEGEND = ("cell: chosen layout (and TRAIN's recompute mode unless none), its predicted stage "
          "seconds and memory per rank (GiB), then the runner-up and how much costlier it is "
          "(+%, incl. the switch); OOM: no layout fits")


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def print_tables(grid: Grid, stages, contexts, loads, header: str, out=None,
                 reasons: bool = False, sglang_fraction: Optional[float] = None) -> None:
    """The grid as one table per stage; where nothing fits, what would (``sglang_fraction``:
    the servers' --mem-fraction-static, which bounds ROLLOUT alone)."""
    from rich.console import Console
    from rich.table import Table
    console = Console(file=out or sys.stdout, width=max(160, 40 + 26 * len(loads)),
                      no_color=True)
    console.print(header)
    for stage in stages:
        table = Table(title=f"{stage.value}: chosen layout per context (rows) and sequences per iteration, total over dp replicas (columns)")
        table.add_column("context")
        for load in loads:
            table.add_column(f"{load} seqs")
        for ctx in contexts:
            table.add_row(_k(ctx), *(cell_text(grid[(stage, ctx, ld)]) for ld in loads))
        console.print(table)
        console.print(f"  {LEGEND}")
        for ctx in contexts:
            for ld in loads:
                r = grid[(stage, ctx, ld)]
                if isinstance(r, LayoutPlan) and r.oom:
                    names = ", ".join(map(str, r.oom[:6])) + (", ..." if len(r.oom) > 6 else "")
                    console.print(f"  {_k(ctx)} x {ld}: {len(r.oom)} of {r.num_valid} valid "
                                  f"layouts exceed the budget ({names})")
                    break
            if reasons:
                for ld in loads:
                    r = grid[(stage, ctx, ld)]
                    if isinstance(r, LayoutPlan):
                        console.print(f"  {_k(ctx)} x {ld}: {r.reason}")
            errs = [grid[(stage, ctx, ld)] for ld in loads
                    if isinstance(grid[(stage, ctx, ld)], NoLayoutFitsError)]
            if errs:
                console.print(f"  {stage.value} {_k(ctx)}: "
                              + _what_fits(errs[-1], stage, sglang_fraction))


def _what_fits(err: NoLayoutFitsError, stage: Stage, sglang_fraction: Optional[float]) -> str:
    if err.suggestions:
        return f"would fit with {'; '.join(err.suggestions)}"
    if stage is Stage.ROLLOUT and sglang_fraction is not None and sglang_fraction < 0.9:
        return (f"nothing tried fits; the servers hold --sglang-mem-fraction {sglang_fraction:g} "
                "of each device: raise it (recipes: 0.8 on cuda), or add devices")
    return "nothing tried fits: add devices (--nodes, --gpus-per-node) or shorten the context"


def write_png(grid: Grid, stages, contexts, loads, path: str, title: str) -> None:
    """Heatmap per stage: colour = chosen layout (legend), text = seconds, GiB, runner-up."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    names = sorted({str(r.layout) for r in grid.values() if isinstance(r, LayoutPlan)})
    index = {n: i + 1 for i, n in enumerate(names)}          # 0 = OOM
    colours = ["#555555"] + [plt.get_cmap("Pastel1" if len(names) <= 9 else "tab20")(i % 20)
                             for i in range(len(names))]
    cell_w, cell_h = 1.8, 0.62
    fig, axes = plt.subplots(1, len(stages), squeeze=False,
                             figsize=(cell_w * len(loads) * len(stages) + 1.2 * len(stages),
                                      cell_h * len(contexts) + 2.6))
    for ax, stage in zip(axes[0], stages):
        data = [[0 if isinstance(grid[(stage, c, ld)], NoLayoutFitsError)
                 else index[str(grid[(stage, c, ld)].layout)] for ld in loads] for c in contexts]
        ax.imshow(data, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1,
                  aspect="auto", origin="lower")
        for i, c in enumerate(contexts):
            for j, ld in enumerate(loads):
                r = grid[(stage, c, ld)]
                if isinstance(r, NoLayoutFitsError):
                    ax.text(j, i, "OOM", ha="center", va="center", fontsize=8, color="white")
                    continue
                lines = [_choice(r.chosen), f"{_seconds(r.predicted_seconds)} "
                                        f"{r.predicted_memory_bytes / 2**30:.0f}G"]
                if r.runner_up is not None and r.chosen.cost > 0:
                    lines.append(f"2nd {r.runner_up.layout} "
                                 f"{r.runner_up.cost / r.chosen.cost - 1:+.1%}")
                ax.text(j, i, "\n".join(lines), ha="center", va="center", fontsize=6.5,
                        color="black", linespacing=1.1)
        ax.set_xticks(range(len(loads)), [str(ld) for ld in loads])
        ax.set_yticks(range(len(contexts)), [_k(c) for c in contexts])
        ax.set_xlabel("sequences per iteration, total over replicas")
        ax.set_ylabel("context length (tokens)")
        ax.set_title(stage.value)
    handles = [Patch(color=colours[index[n]], label=n) for n in names]
    handles.append(Patch(color=colours[0], label="OOM: nothing fits"))
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=7,
               frameon=False)
    fig.suptitle(title + "\n" + LEGEND, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.93))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def compare_rows(selector: Selector, stage: Stage, layouts: Sequence[ParallelLayout],
                 contexts: Sequence[int], responses: Sequence[int], micro_batch_tokens: int,
                 decode_fraction: Optional[float] = None) -> list[dict]:
    """One row per (context, responses, layout). ROLLOUT: ``responses`` per rollout replica, so
    a layout with dp replicas is priced for responses x dp of them; tokens_per_gpu_s counts the
    generated tokens. LOGPROB/TRAIN: ``responses`` sequences in total, tokens = all tokens."""
    world = selector.cluster.world_size
    rows = []
    for ctx in contexts:
        for n in responses:
            for lay in layouts:
                total = n * lay.dp if stage is Stage.ROLLOUT else n
                wl = _workload(stage, ctx, total, micro_batch_tokens, decode_fraction)
                cand = selector.evaluate(lay, wl)
                fits = cand.memory.total <= selector.budget_bytes
                tokens = decode_tokens(wl) if stage is Stage.ROLLOUT else wl.total_tokens
                running = (rollout_running_batch(selector.model, lay, wl, selector.cluster,
                                                 selector.train_opts).running
                           if stage is Stage.ROLLOUT else None)
                rows.append({"stage": stage.value, "context": ctx, "responses": n,
                             "layout": str(lay), "fits": fits,
                             "tokens_per_gpu_s": (tokens / cand.predicted_seconds / world
                                                  if fits else None),
                             "memory_bytes": cand.memory.total,
                             "seconds": cand.predicted_seconds, "running_batch": running})
    return rows


def print_compare(rows: list[dict], layouts, header: str, out=None) -> None:
    out = out or sys.stdout
    print(header, file=out)
    names = [str(lay) for lay in layouts]
    per = "per rollout replica" if rows and rows[0]["stage"] == "rollout" else "in total"
    print(f"tokens per GPU-second (memory per rank; running batch / responses {per}); "
          f"last column: first layout / second", file=out)
    print(f"{'context':>8} {'resp':>5} " + " ".join(f"{n:>26}" for n in names) +
          (f" {'ratio':>7}" if len(names) > 1 else ""), file=out)
    by_key: dict = {}
    for r in rows:
        by_key.setdefault((r["context"], r["responses"]), {})[r["layout"]] = r
    for (ctx, n), cells in by_key.items():
        texts = []
        for name in names:
            r = cells[name]
            run = f" {r['running_batch']}/{n}" if r["running_batch"] is not None else ""
            texts.append((f"{r['tokens_per_gpu_s']:.1f}" if r["fits"] else "OOM") +
                         f" ({r['memory_bytes'] / 2**30:.0f}G{run})")
        a, b = (cells[names[0]]["tokens_per_gpu_s"], cells[names[1]]["tokens_per_gpu_s"]) \
            if len(names) > 1 else (None, None)
        ratio = f" {a / b:>6.2f}x" if a and b else (" " * 7 + "-" if len(names) > 1 else "")
        print(f"{_k(ctx):>8} {n:>5} " + " ".join(f"{t:>26}" for t in texts) + ratio, file=out)


def split_rows(selector: Selector, contexts: Sequence[int], loads: Sequence[int],
               micro_batch_tokens: int, split: str, env_seconds: float,
               decode_fraction: Optional[float] = None, critic: bool = False) -> list[dict]:
    """Colocated against the split (``split``: "auto" or a rollout-pool size) for every
    (context, batch); a plan that does not fit is its SplitDoesNotFitError's text.
    ``critic``: ppo's critic trains where the policy trains (``SplitWorkload.critic``)."""
    rows = []
    for ctx in contexts:
        for load in loads:
            work = SplitWorkload(*(_workload(st, ctx, load, micro_batch_tokens, decode_fraction)
                                   for st in (Stage.ROLLOUT, Stage.LOGPROB, Stage.TRAIN)),
                                 env_seconds=env_seconds, critic=critic)
            row: dict = {"context": ctx, "responses": load}
            for key, ranks in (("colocated", 0), ("split", None if split == "auto"
                                                   else int(split))):
                try:
                    row[key] = plan_split(selector, work, rollout_ranks=ranks)
                except SplitDoesNotFitError as e:
                    row[key] = e
            rows.append(row)
    return rows


def print_split(rows: list[dict], split: str, header: str, reasons: bool, out=None) -> None:
    stream = out or sys.stdout
    print(header, file=stream)
    name = "auto" if split == "auto" else f"{split} rollout ranks"
    print(f"{'context':>8} {'batch':>6}  {'colocated':<44} {'split: ' + name:<66} vs colocated",
          file=stream)

    def cell(p) -> str:
        if isinstance(p, SplitDoesNotFitError):
            return "does not fit"
        if p.colocated:
            return (f"{p.rollout.layout} | {p.logprob.layout} -> {p.train.layout} "
                    f"{_seconds(p.period_s)}")
        return (f"{p.rollout_ranks}/{p.train_ranks}: {p.rollout.layout} | {p.logprob.layout} -> "
                f"{p.train.layout} {_seconds(p.period_s)} ({p.bound_by})")

    for r in rows:
        c, s = r["colocated"], r["split"]
        ratio = (f"{c.period_s / s.period_s:.2f}x" if not isinstance(c, Exception)
                 and not isinstance(s, Exception) else "-")
        print(f"{_k(r['context']):>8} {r['responses']:>6}  {cell(c):<44} {cell(s):<66} {ratio}",
              file=stream)
    print("cells: rollout layout | logprob -> train layout, seconds per iteration (split: "
          "rollout/train ranks; max(rollout, train) + the weight handoff; which side bounds "
          "it); colocated: the stages in turn", file=stream)
    if reasons:
        for r in rows:
            for key in ("colocated", "split"):
                p = r[key]
                why = str(p) if isinstance(p, Exception) else (p.reason or p.describe())
                print(f"  {_k(r['context'])} x {r['responses']} {key}: {why}", file=stream)


def device_counts(args) -> list[int]:
    """World sizes the fewest-devices search tries: 1, 2, 4, ... below a node, then whole nodes
    (1, 2, 4, ... of them, and the cluster's own)."""
    per, nodes = args.gpus_per_node, args.nodes
    counts = [w for w in (2 ** k for k in range(per.bit_length())) if w < per]
    counts += [per * n for n in sorted({2 ** k for k in range(nodes.bit_length())} | {nodes})
               if n <= nodes]
    return counts


def _on_devices(args, world: int) -> ClusterSpec:
    """``cluster_from_args`` with ``world`` devices: part of one node, or whole nodes."""
    per = args.gpus_per_node
    part = argparse.Namespace(**{**vars(args), "nodes": max(1, world // per),
                                 "gpus_per_node": min(world, per)})
    return cluster_from_args(part)


def lora_rows(model: ModelConfig, args, opts: TrainOptions, config: SelectorConfig,
              load: int) -> list[dict]:
    """Per context, TRAIN of ``load`` sequences for the full fine-tune (``model.base``) and the
    LoRA ``model``: the plan on the cluster of ``args`` (or its NoLayoutFitsError), and the
    fewest devices (``device_counts``) with a fitting layout, as (devices, plan) or None."""
    rows = []
    for ctx in args.contexts:
        wl = _workload(Stage.TRAIN, ctx, load, args.micro_batch_tokens, args.decode_fraction)
        row: dict = {"context": ctx}
        for key, m in (("full", model.base), ("lora", model)):
            row[key], row[key + "_fewest"] = _fewest(
                args, lambda world: Selector(m, _on_devices(args, world), opts,
                                             config).plan(wl)[0])
        rows.append(row)
    return rows


def _fewest(args, plan_on, fits=lambda plan: isinstance(plan, LayoutPlan)):
    """(the result of ``plan_on(world)`` on the whole cluster, (devices, result) on the fewest
    ``device_counts`` where it ``fits``, or None); ``plan_on`` returns a plan or raises
    NoLayoutFitsError (the result then). The search stops at the first fit (then only the
    whole cluster's is left)."""
    world_size, whole, fewest = cluster_from_args(args).world_size, None, None
    for world in device_counts(args):
        if fewest is not None and world != world_size:
            continue                                # found: only the whole cluster's row is left
        try:
            plan = plan_on(world)
        except NoLayoutFitsError as e:
            plan = e
        if fewest is None and fits(plan):
            fewest = (world, plan)
        if world == world_size:
            whole = plan
    return whole, fewest


def critic_rows(model: ModelConfig, args, opts: TrainOptions, config: SelectorConfig,
                load: int) -> list[dict]:
    """Per context, TRAIN of ``load`` sequences: the policy's plan without the critic
    ("alone") and with it ("with": {"policy": the plan with the critic's train state in each
    candidate's own layout, "critic": the critic's layout, the plan's, "resident": its bytes
    there, "memory": the critic's own TRAIN there beside the policy's state}), on the whole
    cluster and on the fewest devices where it fits as the trainer counts it."""
    rows = []
    for ctx in args.contexts:
        wl = _workload(Stage.TRAIN, ctx, load, args.micro_batch_tokens, args.decode_fraction)

        def with_critic(world):
            sel = Selector(model, _on_devices(args, world), opts, config)
            try:
                policy = beside_critic(sel).plan(wl)[0]
            except NoLayoutFitsError as e:
                return e
            lay = policy.layout
            return {"policy": policy, "critic": lay, "memory": critic_memory(
                        sel, lay, wl, held_bytes(model, lay, opts)),
                    "resident": held_bytes(critic_model(model), lay, opts)}

        row: dict = {"context": ctx}
        row["alone"], row["alone_fewest"] = _fewest(
            args, lambda world: Selector(model, _on_devices(args, world), opts,
                                         config).plan(wl)[0])
        row["with"], fewest = _fewest(args, with_critic,
                                      fits=lambda r: isinstance(r, dict) and
                                      isinstance(r["policy"], LayoutPlan))
        row["with_fewest"] = fewest and (fewest[0], fewest[1]["policy"])
        rows.append(row)
    return rows


def _plan_cell(p) -> str:
    if not isinstance(p, LayoutPlan):
        return "OOM"
    return f"{_choice(p.chosen)} {p.predicted_memory_bytes / 2**30:.0f}G"


def _fewest_cell(x, world: int) -> str:
    return f"none of <= {world}" if x is None else f"{x[0]}: {_plan_cell(x[1])}"


def print_critic(rows: list[dict], load: int, world: int, budget: int, out=None) -> None:
    stream = out or sys.stdout
    print(f"train, ppo ({load} sequences per context): the policy without and with the "
          f"critic's train state resident, the critic's layout (the TRAIN layout) and its own "
          f"TRAIN at this context, on these {world} devices; the fewest devices on which TRAIN "
          f"fits (with the critic: the policy's, as the trainer counts it)", file=stream)
    print(f"{'context':>8}  {'policy alone':<22} {'policy + critic':<22} {'critic':<34} "
          f"{'fewest, alone':<30} {'fewest, + critic':<30}", file=stream)
    for r in rows:
        w = r["with"]
        if isinstance(w, NoLayoutFitsError):
            policy = critic = "OOM with the critic"
        else:
            policy, m = _plan_cell(w["policy"]), w["memory"]
            critic = f"{w['critic']} +{w['resident'] / 2**30:.0f}G" + (
                "" if m is None else f", own {m.total / 2**30:.0f}G" + (
                    "" if m.total <= budget else " over"))
        print(f"{_k(r['context']):>8}  {_plan_cell(r['alone']):<22} {policy:<22} {critic:<34} "
              f"{_fewest_cell(r['alone_fewest'], world):<30} "
              f"{_fewest_cell(r['with_fewest'], world):<30}", file=stream)
    print("cells: chosen layout (and recompute mode unless none) and GiB per rank; critic: its "
          "layout, +its weights, grads and Adam state resident beside every policy stage, own: "
          "its TRAIN here beside the policy's state, the value head counted as the policy's "
          "output layer and its logits (an overestimate; over: above the budget, which the "
          "trainer refuses before the batch trains); fewest: devices, then the TRAIN layout "
          "there", file=stream)
    print("memory rows (TRAIN on these devices: the policy's, the critic's own):", file=stream)
    for r in rows:
        w = r["with"]
        for key, est in (("policy", w["policy"].chosen.memory
                          if isinstance(w, dict) and isinstance(w["policy"], LayoutPlan)
                          else None), ("critic", w["memory"] if isinstance(w, dict) else None)):
            print(f"  {_k(r['context'])} {key}: {est.describe() if est else 'OOM'}",
                  file=stream)


def print_lora(rows: list[dict], model: ModelConfig, load: int, world: int, out=None) -> None:
    stream = out or sys.stdout
    lora = f"lora r={model.lora.rank}"

    print(f"train, full fine-tune against {lora} ({load} sequences per context): the layout "
          f"each gets on these {world} devices, and the fewest devices on which TRAIN fits",
          file=stream)
    print(f"{'context':>8}  {'full ft':<22} {lora:<22} {'fewest, full ft':<30} "
          f"{'fewest, ' + lora:<30}", file=stream)
    for r in rows:
        print(f"{_k(r['context']):>8}  {_plan_cell(r['full']):<22} {_plan_cell(r['lora']):<22} "
              f"{_fewest_cell(r['full_fewest'], world):<30} "
              f"{_fewest_cell(r['lora_fewest'], world):<30}", file=stream)
    print("cells: chosen layout (and recompute mode unless none) and GiB per rank; fewest: "
          "devices, then the layout chosen there", file=stream)


def _lora_header(model: ModelConfig) -> str:
    if not model.lora.enabled:
        return ""
    n = sum(r.numel for r in tensor_table(model).rows if r.adapter)
    base = num_parameters(model.base)
    return (f"; LoRA r={model.lora.rank} on {','.join(model.lora.targets)}: {n / 1e6:.2f}M "
            f"adapter parameters train ({n / base:.2%} of the base), the base is frozen")


def main(argv: Optional[Sequence[str]] = None, out=None) -> int:
    args = build_parser().parse_args(argv)
    model = model_from_args(args)
    if args.critic and args.compare:
        raise SystemExit("--critic with --compare: --compare prices the policy's layouts "
                         "alone; drop either")
    cluster = cluster_from_args(args)
    auto = args.recompute == "auto"
    opts = TrainOptions(recompute=Recompute.NONE if auto else Recompute(args.recompute),
                        distributed_optimizer=not args.no_distributed_optimizer)
    if args.sglang_mem_fraction is not None:
        cluster = cluster.with_(decode_engine=DecodeEngine.sglang_servers(
            args.sglang_mem_fraction))
    profile = ProfileTable.load(args.profile) if args.profile else None
    selector = Selector(model, cluster, opts,
                        SelectorConfig(memory_margin=args.margin, max_tp=args.max_tp,
                                       auto_recompute=auto), profile)
    stages = [Stage(s.strip()) for s in args.stages.split(",") if s.strip()]
    n = num_parameters(model.base)
    size = (f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M") + " parameters"
    if model.is_moe:        # MoE: layouts include every ep (and etp = tp or 1)
        active = tensor_table(model).active_elements()
        size += (f" ({active / 1e9:.2f}B active: {model.num_experts} experts, top "
                 f"{model.moe_router_topk})")
    header = (f"{args.model}: {size} on {cluster.name} "
              f"({cluster.world_size} devices, budget {human_bytes(selector.budget_bytes)} per "
              f"rank after a {args.margin:.0%} margin); recompute={args.recompute}, "
              f"micro-batch {args.micro_batch_tokens} tokens{_lora_header(model)}")
    if args.critic:
        header += ("; ppo: a critic of the policy's shape, its weights, grads and Adam state "
                   "resident beside every stage")
    stream = out or sys.stdout
    if args.split:
        if args.split != "auto" and not args.split.isdigit():
            raise SystemExit(f"--split {args.split!r}: give auto or a number of rollout ranks")
        rows = split_rows(selector, args.contexts, args.in_flight, args.micro_batch_tokens,
                          args.split, args.env_seconds, args.decode_fraction, args.critic)
        engine = (f"; rollout on SGLang servers (--mem-fraction-static "
                  f"{args.sglang_mem_fraction:g})" if args.sglang_mem_fraction else "")
        print_split(rows, args.split, header + engine, args.reasons, stream)
        return 0
    if args.compare:
        layouts = [ParallelLayout.parse(x, cluster.world_size, model)
                   for x in args.compare.split(",") if x.strip()]
        rows = []
        for stage in stages:
            part = compare_rows(selector, stage, layouts, args.contexts, args.in_flight,
                                args.micro_batch_tokens, args.decode_fraction)
            print_compare(part, layouts, f"{header}; stage {stage.value}", stream)
            rows += part
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
            print(f"wrote {args.json}", file=stream)
        return 0
    if args.json:
        raise SystemExit("--json needs --compare (the grid is printed, or drawn with --png)")
    grid = plan_grid(selector, stages, args.contexts, args.in_flight, args.micro_batch_tokens,
                     args.decode_fraction, args.critic)
    print_tables(grid, stages, args.contexts, args.in_flight, header, out, args.reasons,
                 args.sglang_mem_fraction)
    if model.lora.enabled and Stage.TRAIN in stages:
        load = max(args.in_flight)
        print_lora(lora_rows(model, args, opts, selector.config, load), model, load,
                   cluster.world_size, stream)
    if args.critic and Stage.TRAIN in stages:
        load = max(args.in_flight)
        print_critic(critic_rows(model, args, opts, selector.config, load), load,
                     cluster.world_size, selector.budget_bytes, stream)
    if args.png:
        write_png(grid, stages, args.contexts, args.in_flight, args.png, header)
        print(f"wrote {args.png}", file=stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
