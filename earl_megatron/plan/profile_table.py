"""Measured stage times per layout, context-length bucket and load: calibration for the selector.

The paper this project follows profiles the rollout at start-up and looks the layout up in a
table. Here a table scales the analytic time model instead of replacing it, so that layouts and
contexts never measured still get a prediction::

    table = ProfileTable()
    table = table.record(Stage.TRAIN, layout, context_bucket=2048, load=8, seconds=0.41)
    table.save("profile.json"); table = ProfileTable.load("profile.json")
    factor = table.scale_factor(Stage.TRAIN, layout, context=3000, load=8,
                                analytic_for=lambda lay: lambda ctx, ld: seconds(lay, ctx, ld))

``load`` is the number of sequences of the measured step (responses in flight for ROLLOUT).

Server restarts (rollout.engine=sglang): ``record_restart(model, tp, seconds)`` keeps the
measured seconds of the last start of inference servers with that tp for that model (a
plan/server_restart.py ``model_key``); ``restart_seconds(model, tp)`` reads it back (None: never
measured, the selector takes its configured default). The trainer records every start and saves
the table with its checkpoints. Files without a ``restarts`` list (older ones) load with none.
The scale factor is measured / analytic at each measured point, interpolated linearly in
log2(context) between buckets and in log2(load) between loads, clamped outside the measured
range. A layout with no entry for the stage gets the geometric mean factor of the stage's measured
layouts (the hardware's overall offset from the model), or 1.0 when the stage has none.

Invariants: a table is a frozen value (``record`` returns a new one); entries are kept sorted and
a (stage, layout, context_bucket, load) key appears once (the latest record wins); ``load`` of a
file whose ``schema_version`` differs, or that is malformed, raises ``ProfileTableError`` saying
which field is wrong. A layout is stored as {tp, cp, pp, dp} plus ep and etp when an MoE layout
sets them (files of dense layouts are unchanged, and load as before).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.specs import Stage

SCHEMA_VERSION = 1


def _layout_json(layout: ParallelLayout) -> dict:
    """A layout's axes; ep and etp only when set (a dense table's file is unchanged)."""
    out = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp}
    if layout.ep > 1:
        out["ep"] = layout.ep
    if layout.etp is not None:
        out["etp"] = layout.etp
    return out


class ProfileTableError(ValueError):
    """A profile file that cannot be used: says what is wrong and how to regenerate it."""


@dataclass(frozen=True, order=True)
class ProfileEntry:
    stage: str
    """Stage value ("rollout", "logprob", "train")."""
    layout: ParallelLayout
    context_bucket: int
    """Longest context of the measured step, in tokens."""
    load: int
    seconds: float
    """Measured wall-clock seconds of the whole stage step (median of repeats)."""


@dataclass(frozen=True, order=True)
class RestartEntry:
    model: str
    """The model's key (plan/server_restart.py ``model_key``)."""
    tp: int
    seconds: float
    """Measured wall-clock seconds of the servers' last (re)start (stop, start, weight group)."""


def _key(e: ProfileEntry) -> tuple:
    return (e.stage, e.layout, e.context_bucket, e.load)


@dataclass(frozen=True)
class ProfileTable:
    entries: tuple[ProfileEntry, ...] = ()
    meta: tuple[tuple[str, str], ...] = ()
    """Free-form provenance (model, cluster, date, tool version) as sorted (key, value) pairs."""
    restarts: tuple[RestartEntry, ...] = ()
    """Measured server restarts, one per (model, tp), sorted."""

    def record(self, stage: Stage, layout: ParallelLayout, context_bucket: int, load: int,
               seconds: float) -> "ProfileTable":
        """A new table with this measurement added (replacing one with the same key)."""
        if not isinstance(stage, Stage):
            raise ProfileTableError(f"stage must be a Stage, got {stage!r}")
        if context_bucket <= 0 or load <= 0:
            raise ProfileTableError(f"context_bucket and load must be positive, got "
                                    f"{context_bucket}, {load}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ProfileTableError(f"seconds must be a positive finite number, got {seconds}")
        new = ProfileEntry(stage.value, layout, int(context_bucket), int(load), float(seconds))
        kept = [e for e in self.entries if _key(e) != _key(new)]
        return ProfileTable(tuple(sorted(kept + [new])), self.meta, self.restarts)

    def record_restart(self, model: str, tp: int, seconds: float) -> "ProfileTable":
        """A new table with this server restart measurement (replacing the (model, tp) one)."""
        if not isinstance(model, str) or not model:
            raise ProfileTableError(f"restart model must be a non-empty string, got {model!r}")
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise ProfileTableError(f"restart tp must be a positive int, got {tp!r}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ProfileTableError(f"restart seconds must be a positive finite number, got "
                                    f"{seconds}")
        kept = [r for r in self.restarts if (r.model, r.tp) != (model, tp)]
        new = RestartEntry(model, tp, float(seconds))
        return ProfileTable(self.entries, self.meta, tuple(sorted(kept + [new])))

    def restart_seconds(self, model: str, tp: int) -> Optional[float]:
        """The measured restart seconds of (model, tp); None if never measured."""
        return next((r.seconds for r in self.restarts if (r.model, r.tp) == (model, tp)), None)

    def with_meta(self, **meta: str) -> "ProfileTable":
        merged = dict(self.meta) | {k: str(v) for k, v in meta.items()}
        return ProfileTable(self.entries, tuple(sorted(merged.items())), self.restarts)

    def _points(self, stage: Stage, layout: ParallelLayout) -> dict[int, list[tuple[int, float]]]:
        """load -> [(context_bucket, seconds)] ascending, for one stage and layout."""
        out: dict[int, list[tuple[int, float]]] = {}
        for e in self.entries:
            if e.stage == stage.value and e.layout == layout:
                out.setdefault(e.load, []).append((e.context_bucket, e.seconds))
        return out

    def layouts(self, stage: Stage) -> tuple[ParallelLayout, ...]:
        return tuple(sorted({e.layout for e in self.entries if e.stage == stage.value}))

    def lookup(self, stage: Stage, layout: ParallelLayout, context: int,
               load: int) -> Optional[float]:
        """Measured seconds interpolated to (context, load); None if the layout has no entry."""
        return self._interpolate(stage, layout, context, load, lambda ctx, ld, s: s)

    def layout_factor(self, stage: Stage, layout: ParallelLayout, context: int, load: int,
                      analytic: Callable[[int, int], float]) -> Optional[float]:
        """measured / analytic(ctx, load) for this layout, interpolated; None without data."""
        def ratio(ctx: int, ld: int, seconds: float) -> float:
            predicted = analytic(ctx, ld)
            if not predicted > 0:
                raise ProfileTableError(f"analytic model gave {predicted} s at context {ctx}, "
                                        f"load {ld}: cannot calibrate against it")
            return seconds / predicted
        return self._interpolate(stage, layout, context, load, ratio, log=True)

    def scale_factor(self, stage: Stage, layout: ParallelLayout, context: int, load: int,
                     analytic_for: Callable[[ParallelLayout], Callable[[int, int], float]]
                     ) -> float:
        """Factor to multiply the analytic seconds of ``layout`` by (see the module docstring).

        ``analytic_for(layout)`` returns that layout's analytic(context, load) -> seconds."""
        own = self.layout_factor(stage, layout, context, load, analytic_for(layout))
        if own is not None:
            return own
        logs = [math.log(self.layout_factor(stage, lay, context, load, analytic_for(lay)))
                for lay in self.layouts(stage)]
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    def _interpolate(self, stage, layout, context, load, value, log=False) -> Optional[float]:
        points = self._points(stage, layout)
        if not points:
            return None
        loads = sorted(points)
        lo, hi, w = _bracket(loads, load)
        v_lo = _interp_context(points[lo], context, lambda c, s: value(c, lo, s), log)
        if hi == lo:
            return v_lo
        v_hi = _interp_context(points[hi], context, lambda c, s: value(c, hi, s), log)
        return _mix(v_lo, v_hi, w, log)

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "meta": dict(self.meta),
                "entries": [{"stage": e.stage, "layout": _layout_json(e.layout),
                             "context_bucket": e.context_bucket, "load": e.load,
                             "seconds": e.seconds} for e in self.entries],
                "restarts": [{"model": r.model, "tp": r.tp, "seconds": r.seconds}
                             for r in self.restarts]}

    @classmethod
    def from_json(cls, data: object, source: str = "<data>") -> "ProfileTable":
        def bad(why: str) -> ProfileTableError:
            return ProfileTableError(f"{source}: {why}. Regenerate it with "
                                     "tools/profile_layouts.py")
        if not isinstance(data, dict):
            raise bad(f"top level must be an object, got {type(data).__name__}")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise bad(f"schema_version is {data.get('schema_version')!r}, this code reads "
                      f"{SCHEMA_VERSION}")
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise bad("'entries' must be a list")
        table = cls(meta=tuple(sorted((str(k), str(v)) for k, v in
                                      (data.get("meta") or {}).items())))
        stages = {s.value: s for s in Stage}
        for i, e in enumerate(entries):
            try:
                stage = stages[e["stage"]]
                layout = ParallelLayout(**{a: e["layout"][a] for a in ("tp", "cp", "pp", "dp")},
                                        **{a: e["layout"][a] for a in ("ep", "etp")
                                           if a in e["layout"]})
                table = table.record(stage, layout, e["context_bucket"], e["load"], e["seconds"])
            except (KeyError, TypeError, ValueError) as exc:
                raise bad(f"entry {i} is malformed ({type(exc).__name__}: {exc}); expected keys "
                          "stage, layout{tp,cp,pp,dp[,ep,etp]}, context_bucket, load, seconds") from None
        restarts = data.get("restarts", [])
        if not isinstance(restarts, list):
            raise bad("'restarts' must be a list")
        for i, r in enumerate(restarts):
            try:
                table = table.record_restart(r["model"], r["tp"], r["seconds"])
            except (KeyError, TypeError, ValueError) as exc:
                raise bad(f"restart {i} is malformed ({type(exc).__name__}: {exc}); expected "
                          "keys model, tp, seconds") from None
        return table

    def save(self, path: "str | Path") -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: "str | Path") -> "ProfileTable":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ProfileTableError(f"{path}: not valid JSON ({exc}). Regenerate it with "
                                    "tools/profile_layouts.py") from None
        return cls.from_json(data, str(path))


def _bracket(xs: list[int], x: float) -> tuple[int, int, float]:
    """Neighbours of x in ascending xs and the log2-weight of the upper one (clamped)."""
    if x <= xs[0]:
        return xs[0], xs[0], 0.0
    if x >= xs[-1]:
        return xs[-1], xs[-1], 0.0
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return x, x, 0.0
    lo, hi = xs[i - 1], xs[i]
    return lo, hi, (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))


def _interp_context(points, context, value, log) -> float:
    ctxs = [c for c, _ in points]
    lo, hi, w = _bracket(ctxs, context)
    v_lo = value(lo, points[ctxs.index(lo)][1])
    if hi == lo:
        return v_lo
    return _mix(v_lo, value(hi, points[ctxs.index(hi)][1]), w, log)


def _mix(a: float, b: float, w: float, log: bool) -> float:
    """Interpolate seconds linearly; ratios geometrically (a factor of 2 and 0.5 average to 1)."""
    return math.exp((1 - w) * math.log(a) + w * math.log(b)) if log else (1 - w) * a + w * b
