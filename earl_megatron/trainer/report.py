"""End-of-run report: one PNG with reward and win rate, context length, the layout of each stage
over time, stage times and dispatch bytes (rank 0 only, from metrics already recorded)."""

from __future__ import annotations

from pathlib import Path


def write_report(out: Path, history: list[dict], evals: dict) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [h["iteration"] for h in history]
    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    a = ax[0][0]
    a.plot(its, [h["reward"] for h in history], label="mean reward")
    a.plot(its, [h["win_rate"] for h in history], label="win rate (sampling)")
    a.plot(its, [h["illegal_rate"] + h["unparsable_rate"] for h in history],
           label="illegal + unparsable")
    a.set_title("reward")
    a.legend()
    a = ax[0][1]
    a.plot(its, [h["mean_context"] for h in history], label="mean")
    a.plot(its, [h["max_context"] for h in history], label="max")
    a.set_title("context length (tokens)")
    a.legend()
    a = ax[0][2]
    names = sorted({v for h in history for v in h["layouts"].values()})
    for k, stage in enumerate(("rollout", "train")):
        a.scatter(its, [names.index(h["layouts"][stage]) + 0.1 * k for h in history],
                  label=stage, s=12)
    a.set_yticks(range(len(names)), names)
    a.set_title("layout per stage")
    a.legend()
    a = ax[1][0]
    for key in ("rollout", "train", "plan+switch", "switch"):
        a.plot(its, [h["seconds"].get(key, 0.0) for h in history], label=key)
    a.set_title("stage time (s)")
    a.legend()
    a = ax[1][1]
    a.plot(its, [h.get("dispatch_bytes", 0) / 2**20 for h in history])
    a.set_title("dispatch MiB received (rank 0)")
    a = ax[1][2]
    a.axis("off")
    lines = [f"{when}: " + ", ".join(f"{opp} win {v['win_rate']:.2f}" for opp, v in r.items())
             for when, r in evals.items()]
    a.text(0, 1, "greedy evaluation\n" + "\n".join(lines), va="top", family="monospace")
    fig.tight_layout()
    path = Path(out) / "report.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
