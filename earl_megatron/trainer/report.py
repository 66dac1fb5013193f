"""End-of-run report: one PNG (rank 0, from the records already in metrics.jsonl and eval.json).

    reward (+ illegal/unparsable)  | win rate: training (sampled) | context length: mean, max
                                   | + evaluations as markers     |
    layout of each stage over time | stage seconds, stacked       | dispatch MiB (rank 0)

A tool-use run (records with "accuracy") shows, in the win-rate panel's place, accuracy, tool
calls per episode, tool-error and unparsable rates, with the accuracy of evaluations as markers;
a supervised warm start (``sft``: records with step and loss, sft.jsonl) adds a fourth column
with its loss per step.

x is the iteration index. An evaluation taken after n iterations (eval keys "start" = 0,
"iter<n>", "end" = all) is drawn at x = n - 1, the last iteration it saw, so "start" sits at -1.

Invariants: only reads history and evals; any key may be missing (older histories), a history of
one iteration (or none) still yields a readable PNG; the function signature stays
write_report(out_dir, history, evals).
"""

from __future__ import annotations

import math
from pathlib import Path

from earl_megatron.stages import ITERATION_TIMERS, STAGE_NAMES

# the seconds are stacked from the bottom in loop order (ITERATION_TIMERS); unknown keys go on
# top, "total" is the sum, not a part
# one colour per stage in every panel
COLOURS = {"rollout": "tab:orange", "logprob": "tab:green", "train": "tab:purple",
           "plan+switch": "tab:gray", "switch": "tab:red"}


def _get(h: dict, key: str) -> float:
    v = h.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def eval_x(when: str, history: list[dict]) -> float | None:
    """Where an evaluation goes on the iteration axis (None when its key is not understood)."""
    if when == "start":
        return -1.0
    if when == "end":
        return float(history[-1].get("iteration", len(history) - 1)) if history else 0.0
    if when.startswith("iter") and when[4:].isdigit():
        return float(int(when[4:]) - 1)
    return None


def write_report(out: Path, history: list[dict], evals: dict,
                 sft: list[dict] | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    history = list(history or [])
    evals = evals or {}
    its = [h.get("iteration", i) for i, h in enumerate(history)]
    line = dict(marker="o", markersize=3)  # a one-iteration history still shows its point
    sft = list(sft or [])
    fig, ax = plt.subplots(2, 4 if sft else 3, figsize=(21 if sft else 16, 8.5))
    if sft:
        a = ax[0][3]
        a.plot([r.get("step", i) for i, r in enumerate(sft)], [_get(r, "loss") for r in sft],
               **line)
        a.set_title("warm start: loss per agent token")
        a.set_xlabel("supervised step")
        ax[1][3].axis("off")

    a = ax[0][0]
    a.plot(its, [_get(h, "reward") for h in history], label="mean reward", **line)
    a.plot(its, [_get(h, "illegal_rate") + _get(h, "unparsable_rate") for h in history],
           label="illegal + unparsable", **line)
    a.set_title("reward")
    a.set_xlabel("iteration")
    a.legend(fontsize=8)

    a = ax[0][1]
    tool = any("accuracy" in h for h in history)
    score = "accuracy" if tool else "win_rate"
    a.plot(its, [_get(h, score) for h in history], label="training (sampled)", **line)
    if tool:
        a.plot(its, [_get(h, "tool_calls") for h in history], label="tool calls / episode",
               **line)
        a.plot(its, [_get(h, "tool_error_rate") for h in history], label="tool errors", **line)
        a.plot(its, [_get(h, "unparsable_rate") for h in history], label="unparsable", **line)
    markers = "s^vDP*Xh"
    for k, name in enumerate(sorted({n for r in evals.values() for n in (r or {})})):
        pts = [(eval_x(when, history), r[name][score]) for when, r in evals.items()
               if name in (r or {}) and eval_x(when, history) is not None
               and isinstance(r[name], dict) and score in r[name]]
        if pts:
            a.plot(*zip(*sorted(pts)), linestyle=":", marker=markers[k % len(markers)], markersize=7,
                   label=f"eval {name}")
    a.set_ylim(-0.05, max([1.05] + [_get(h, "tool_calls") + 0.05 for h in history
                                    if tool and not math.isnan(_get(h, "tool_calls"))]))
    a.set_title("accuracy and tool use" if tool else "win rate (evaluations as markers)")
    a.set_xlabel("iteration")
    a.legend(fontsize=8)

    a = ax[0][2]
    a.plot(its, [_get(h, "mean_context") for h in history], label="mean", **line)
    a.plot(its, [_get(h, "max_context") for h in history], label="max", **line)
    a.set_title("context length (tokens)")
    a.set_xlabel("iteration")
    a.legend(fontsize=8)

    a = ax[1][0]
    layouts = [h.get("layouts") or {} for h in history]
    stages = [s for s in STAGE_NAMES if any(s in lay for lay in layouts)]
    stages += sorted({s for lay in layouts for s in lay} - set(stages))
    names = sorted({str(v) for lay in layouts for v in lay.values()})
    for k, stage in enumerate(stages):
        # offset each stage a little so equal layouts stay visible as separate lines
        y = [names.index(str(lay[stage])) + 0.08 * (k - (len(stages) - 1) / 2)
             if stage in lay else math.nan for lay in layouts]
        a.step(its, y, where="mid", label=stage, color=COLOURS.get(stage), **line)
    if names:
        a.set_yticks(range(len(names)), names)
        a.set_ylim(-0.5, len(names) - 0.5)
    a.set_title("layout per stage")
    a.set_xlabel("iteration")
    if stages:
        a.legend(fontsize=8)

    a = ax[1][1]
    seconds = [h.get("seconds") or {} for h in history]
    keys = [k for k in ITERATION_TIMERS if any(k in s for s in seconds)]
    keys += sorted({k for s in seconds for k in s} - set(keys) - {"total"})
    bottom = [0.0] * len(history)
    for key in keys:
        vals = [float(s.get(key) or 0.0) for s in seconds]
        a.bar(its, vals, bottom=bottom, width=0.8, label=key, color=COLOURS.get(key))
        bottom = [b + v for b, v in zip(bottom, vals)]
    a.set_title("seconds per stage (stacked)")
    a.set_xlabel("iteration")
    if keys:
        a.legend(fontsize=8)

    a = ax[1][2]
    a.bar(its, [_get(h, "dispatch_bytes") / 2**20 for h in history], width=0.8)
    a.set_title("dispatch MiB received (rank 0)")
    a.set_xlabel("iteration")

    xs = its + [x for x in map(lambda w: eval_x(w, history), evals) if x is not None]
    for a in (row[c] for row in ax for c in range(3)):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        if xs:  # a single iteration would otherwise get a +-0.05 axis
            a.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    if not history:
        fig.suptitle("no iterations recorded")
    fig.tight_layout()
    path = Path(out) / "report.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
