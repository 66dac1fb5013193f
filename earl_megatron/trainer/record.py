"""What the trainer records: stage timers, one metrics line per iteration, the evaluations.

Every rank calls ``Recorder.record`` (it gathers episode outcomes); rank 0 appends the line to
``metrics.jsonl``, shows it in the live view and hands it and each evaluation to the trackers of
run.loggers (earl_megatron/trackers: the iteration is the step, an evaluation's step the
iterations done when it ran). Invariant: metrics.jsonl holds exactly one
line per iteration the run's history knows: ``start`` rewrites it from the (checkpointed)
history, so a run killed between its metrics line and its checkpoint never leaves a repeated
or stale iteration (the resumed run replays the dropped ones). A new run (run.resume=false)
never reaches here in a folder that holds an earlier run's metrics: it is refused first
(trainer/segments.earlier_run), so no history is ever truncated silently. eval.json holds every
segment's evaluations (trainer/segments.py), rewritten after each evaluation.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from earl_megatron.envs.tool_env import tool_metrics
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.rollout.agent_loop import Episode
from earl_megatron.runtime import groups
from earl_megatron.trackers import eval_step
from earl_megatron.trainer import segments


def tool_row(e: Episode) -> Optional[tuple]:
    """An episode's (correct, tool calls, tool error, unparsable, turns) for
    envs.tool_env.tool_metrics; None for environments without tools (no "tool_calls" info)."""
    if "tool_calls" not in e.info:
        return None
    return (bool(e.info.get("correct")), int(e.info["tool_calls"]),
            bool(e.info.get("tool_error")), bool(e.info.get("unparsable")), e.turns)


def _recorded(f: Path) -> list[int]:
    """The iterations of a metrics.jsonl's lines (a line cut by a kill is skipped)."""
    if not f.is_file():
        return []
    its = []
    for line in f.read_text().splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            its.append(int(json.loads(line)["iteration"]))
    return its


class StageTimer:
    """Wall seconds per named stage of one iteration, in the order they ran; on a GPU also each
    stage's peak allocated device memory (torch's allocator, this rank), the measured beside the
    selector's predicted memory (``peaks_gb``; a CPU run records none: its process memory is
    mostly the Python runtime, not what the memory model predicts)."""

    def __init__(self, carried: Optional[dict] = None):
        self.seconds: dict[str, float] = dict(carried or {})
        """``carried`` (taken: emptied here): seconds spent for this iteration before it
        started (auto's move to the placement that plays it), counted in its total."""
        if carried:
            carried.clear()
        self.t0 = time.perf_counter() - sum(self.seconds.values())
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t
            if cuda:
                self.peaks[stage] = max(self.peaks.get(stage, 0),
                                        torch.cuda.max_memory_allocated())

    def peaks_gb(self) -> dict[str, float]:
        """{stage: peak allocated GiB} (empty without a GPU)."""
        return {k: v / 2**30 for k, v in self.peaks.items()}

    def total(self) -> dict[str, float]:
        return {**self.seconds, "total": time.perf_counter() - self.t0}


def gather_by_sample(ids: list[int], values: list) -> dict:
    """{sample id: value} of every rank's samples, over this rank's pool (every rank of a
    replica holds the same ones: each sample appears once)."""
    parts: list = [None] * groups.pool_span()[1]
    dist.all_gather_object(parts, list(zip(ids, values)), group=groups.pool_group())
    return {s: v for part in parts for s, v in part}


class Recorder:
    def __init__(self, out: Path, history: list[dict], view, rank: int, trackers=None):
        self.out, self.history, self.view, self.rank = out, history, view, rank
        self.trackers = trackers   # earl_megatron.trackers.Trackers (rank 0's), or None

    def start(self, first_iteration: int = 0) -> list[str]:
        """``first_iteration`` > 0: a resumed segment; the earlier segments' evaluations stay.
        Returns the line saying which recorded iterations were dropped (none: [])."""
        self.first = first_iteration
        self.evals_before = segments.read_evals(self.out) \
            if first_iteration > 0 and self.rank == 0 else {}
        self.evals: dict = {}
        if self.rank != 0:
            return []
        self.out.mkdir(parents=True, exist_ok=True)
        f = self.out / "metrics.jsonl"
        dropped = sorted(set(_recorded(f)) - {h["iteration"] for h in self.history})
        f.write_text("".join(json.dumps(h) + "\n" for h in self.history))
        if not dropped:
            return []
        which = f"iteration {dropped[0]}" if len(dropped) == 1 else \
            f"iterations {dropped[0]}-{dropped[-1]}"
        return [f"{f}: dropped the lines of {which}, recorded after the checkpoint this run "
                "resumed from; it replays them"]

    def evaluation(self, when: str, result: dict) -> None:
        """One evaluation of this segment; eval.json (all segments) is rewritten at once."""
        self.evals[when] = result
        if self.rank == 0:
            segments.write_evals(self.out, self.merged_evals())
            if self.trackers is not None:
                self.trackers.log_eval(result, eval_step(when, self.history, self.first))

    def merged_evals(self) -> dict:
        return segments.merge_evals(self.evals_before, self.first, self.evals)

    def record(self, it: int, layouts: dict[str, ParallelLayout], ids: list[int],
               episodes: list[Episode], lengths: list[int], seconds: dict[str, float],
               metrics: dict, planner) -> dict:
        rows = gather_by_sample(ids, [(e.reward, e.info.get("outcome"),
                                       bool(e.info.get("illegal")),
                                       bool(e.info.get("unparsable")), tool_row(e))
                                      for e in episodes])
        rows = [rows[s] for s in sorted(rows)]
        n = max(len(rows), 1)
        rec = {"iteration": it,
               "layouts": {k: str(v) for k, v in layouts.items()},
               "reward": sum(r[0] for r in rows) / n,
               "win_rate": sum(r[1] == "win" for r in rows) / n,
               "illegal_rate": sum(r[2] for r in rows) / n,
               "unparsable_rate": sum(r[3] for r in rows) / n,
               # tool environments: accuracy, tool calls per episode, tool errors, unparsable
               **(tool_metrics([r[4] for r in rows]) if any(r[4] for r in rows) else {}),
               "mean_context": sum(lengths) / len(lengths), "max_context": max(lengths),
               **metrics, "seconds": seconds}
        rec["predicted_memory_gb"] = {k: v / 2**30 for k, v in planner.predicted_memory.items()}
        if planner.predicted_seconds:
            rec["predicted_seconds"] = dict(planner.predicted_seconds)
        if planner.reasons:
            rec["layout_reasons"] = dict(planner.reasons)
        if planner.recompute:
            rec["recompute"] = dict(planner.recompute)
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if self.trackers is not None:
                self.trackers.log(rec)
        self.view.update(rec)
        self.history.append(rec)
        return rec

    def skipped(self, it: int, layouts: dict, seconds: dict, metrics: dict, why: str) -> dict:
        """An iteration that trained nothing (dynamic sampling kept no group with signal):
        its line holds the stage's metrics and ``skipped``, no loss; every rank calls it."""
        rec = {"iteration": it, "layouts": {k: str(v) for k, v in layouts.items()},
               **metrics, "skipped": why, "seconds": seconds}
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if self.trackers is not None:
                self.trackers.log(rec)
        self.view.update(rec)
        self.history.append(rec)
        return rec

    def finish(self) -> None:
        if self.rank != 0:
            return
        merged = self.merged_evals()
        segments.write_evals(self.out, merged)
        for when, res in self.evals.items():
            self.view.message(f"evaluation {when}: " + ", ".join(
                f"{k} accuracy {v['accuracy']:.2f}, tool calls {v['tool_calls']:.2f}"
                if "accuracy" in v else f"{k} win {v['win_rate']:.2f}" for k, v in res.items()))
        from earl_megatron.trainer.report import write_report
        # the warm start's records (trainer/warm_start.py), also when RL resumed after it
        sft_file = self.out / "sft.jsonl"
        sft = [json.loads(x) for x in sft_file.read_text().splitlines()] \
            if sft_file.exists() else []
        write_report(self.out, self.history, merged, sft=sft)
