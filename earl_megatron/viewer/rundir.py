"""What ``earl view`` shows, read from a run directory as the trainer writes it (no HTTP here).

    RUN_DIR/metrics.jsonl          one record per iteration (trainer/record.py)
    RUN_DIR/eval.json              {"start" | "iter<n>" | "end": {opponent/mode: {...}}}
    RUN_DIR/resolved.json          the run's configuration
    RUN_DIR/samples/iter_N.jsonl   rank 0's decoded episodes (trainer/samples.py)
    RUN_DIR/samples/iter_N.rD.jsonl  replica D's (run.samples_all_replicas)

Invariants: reading never writes and never fails on a file being written (a line cut by a kill
or still being appended is skipped; a missing file is empty), so a live run and a finished one
read alike; each file is parsed again only when its size or modification time changed, so a page
polling a finished run costs a stat per file. A folder holding none of the run's files is refused
with ``NotARun`` naming the fix. Samples are addressed by a key "iteration.replica.sample"
(replica "-" for rank 0's file), stable as other files appear.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Optional

from earl_megatron.stages import ITERATION_TIMERS, STAGE_NAMES
from earl_megatron.viewer.conversation import conversation

RUN_FILES = ("metrics.jsonl", "eval.json", "resolved.json", "samples")
SAMPLE_NAME = re.compile(r"^iter_(\d+)(?:\.r(\d+))?\.jsonl$")
SUMMARY_KEYS = ("iteration", "sample", "env", "seed", "reward", "finish_reason", "turns",
                "tokens", "policy_tokens", "turn_versions")


class NotARun(ValueError):
    """The folder given is not a run directory."""


def check_run_dir(path) -> Path:
    """``path`` as a Path when it is a run directory (it holds one of RUN_FILES), else NotARun."""
    p = Path(path)
    if not p.is_dir():
        raise NotARun(f"{p}: no such directory; give a run's output directory "
                      f"(run.output_dir), e.g. earl view runs/cpu_demo")
    if not any((p / name).exists() for name in RUN_FILES):
        raise NotARun(f"{p} is not a run directory: it holds none of "
                      f"{', '.join(RUN_FILES)}; give the run's run.output_dir "
                      f"(the folder `earl train` wrote them to)")
    return p


def _lines(text: str) -> list[dict]:
    """The JSON objects of a JSONL text; a cut or unreadable line is skipped."""
    out = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def _json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


class _Cached:
    """One file's parsed content, parsed again when its (size, mtime) changes."""

    def __init__(self, path: Path, parse):
        self.path, self.parse, self.stamp, self.value = path, parse, None, None

    def get(self):
        try:
            st = self.path.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamp = None
        if stamp != self.stamp or self.value is None:
            self.value = self.parse(self.path) if stamp is not None else self.parse(None)
            self.stamp = stamp
        return self.value


def _parse_metrics(path: Optional[Path]) -> list[dict]:
    if path is None:
        return []
    try:
        return [r for r in _lines(path.read_text()) if isinstance(r.get("iteration"), int)]
    except OSError:
        return []


def number(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def stage_order(names) -> list[str]:
    """Stages in the loop's order (stages.STAGE_NAMES, ITERATION_TIMERS), unknown ones after."""
    known = [s for s in (*STAGE_NAMES, *ITERATION_TIMERS) if s in names]
    known = list(dict.fromkeys(known))
    return known + sorted(set(names) - set(known) - {"total"})


def layout_view(records: list[dict], samples: list[dict]) -> dict:
    """The layouts view: per stage and iteration the layout, recompute, the selector's reason,
    predicted memory (and measured memory, predicted seconds where recorded) beside the stage's
    measured seconds; the switches; the context length per iteration and its distribution over
    the written samples."""
    stages = stage_order({s for r in records for s in (r.get("layouts") or {})})
    rows, switches, last = [], [], {}
    for r in records:
        it, lay = r["iteration"], r.get("layouts") or {}
        for s in stages:
            if s not in lay:
                continue
            pick = lambda key: (r.get(key) or {}).get(s) if isinstance(r.get(key), dict) \
                else None  # noqa: E731 - a lookup used six times below
            row = {"iteration": it, "stage": s, "layout": str(lay[s]),
                   "reason": pick("layout_reasons"), "recompute": pick("recompute"),
                   "predicted_memory_gb": number(pick("predicted_memory_gb")),
                   "measured_memory_gb": number(pick("measured_memory_gb")),
                   "predicted_seconds": number(pick("predicted_seconds")),
                   "seconds": number(pick("seconds"))}
            rows.append(row)
            if s in last and last[s] != row["layout"]:
                switches.append({"iteration": it, "stage": s, "from": last[s],
                                 "to": row["layout"], "reason": row["reason"]})
            last[s] = row["layout"]
    tokens = sorted(int(t) for t in (x.get("tokens") for x in samples) if number(t) is not None)
    return {"stages": stages, "rows": rows, "switches": switches,
            "context": [{"iteration": r["iteration"], "mean": number(r.get("mean_context")),
                         "max": number(r.get("max_context"))} for r in records],
            "histogram": histogram(tokens),
            "split_plans": [{"iteration": r["iteration"], "plan": r["split"]["plan"]}
                            for r in records if isinstance(r.get("split"), dict)
                            and r["split"].get("plan")]}


def histogram(values: list[int], bins: int = 20) -> list[dict]:
    """[{lo, hi, count}] over equal-width bins of ``values`` (empty: [])."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    width = max((hi - lo + 1) / bins, 1.0)
    n = min(bins, hi - lo + 1)
    counts = [0] * n
    for v in values:
        counts[min(int((v - lo) / width), n - 1)] += 1
    return [{"lo": lo + round(k * width), "hi": lo + round((k + 1) * width) - 1, "count": c}
            for k, c in enumerate(counts)]


def sample_key(row: dict) -> str:
    rep = row.get("_replica")
    return f"{row.get('iteration')}.{'-' if rep is None else rep}.{row.get('sample')}"


def summary(row: dict) -> dict:
    """What the episode list shows of a sample (the full record: ``RunDir.sample``)."""
    info = row.get("info") if isinstance(row.get("info"), dict) else {}
    out = {k: row.get(k) for k in SUMMARY_KEYS}
    out.update(key=sample_key(row), replica=row.get("_replica"),
               tool_calls=info.get("tool_calls"), fork=info.get("fork"),
               fork_reason=info.get("fork_reason"), correct=info.get("correct"),
               outcome=info.get("outcome"),
               flags=sorted(k for k in ("unparsable", "illegal", "tool_error", "malformed_call",
                                        "tool_budget", "agent_error", "agent_timeout")
                            if info.get(k)))
    return out


class RunDir:
    """A run directory read as it is written; thread-safe (the server's threads share one)."""

    def __init__(self, path):
        self.path = check_run_dir(path)
        self._lock = threading.Lock()
        self._metrics = _Cached(self.path / "metrics.jsonl", _parse_metrics)
        self._files: dict[str, _Cached] = {}

    def metrics(self) -> list[dict]:
        with self._lock:
            return self._metrics.get()

    def evals(self) -> dict:
        got = _json(self.path / "eval.json", {})
        return got if isinstance(got, dict) else {}

    def config(self) -> Optional[dict]:
        got = _json(self.path / "resolved.json", None)
        return got if isinstance(got, dict) else None

    def samples(self) -> list[dict]:
        """Every written sample (full records, with ``_replica`` and ``_search``), in
        (iteration, replica, sample) order."""
        folder = self.path / "samples"
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        out = []
        with self._lock:
            for name in list(self._files):
                if name not in names:
                    del self._files[name]
            for name in names:
                m = SAMPLE_NAME.match(name)
                if not m:
                    continue
                if name not in self._files:
                    rep = None if m.group(2) is None else int(m.group(2))
                    self._files[name] = _Cached(folder / name,
                                                lambda p, rep=rep: _parse_samples(p, rep))
                out += self._files[name].get()
        return sorted(out, key=lambda r: (r.get("iteration") or 0,
                                          -1 if r["_replica"] is None else r["_replica"],
                                          r.get("sample") or 0))

    def sample(self, key: str) -> Optional[dict]:
        """The sample of ``key`` with its conversation, and the rows of its episode (an agent
        episode's forks: the same iteration, replica, environment and seed)."""
        rows = self.samples()
        found = next((r for r in rows if sample_key(r) == key), None)
        if found is None:
            return None
        same = [summary(r) for r in rows if r.get("env") == found.get("env")
                and r.get("seed") == found.get("seed") and r.get("iteration") ==
                found.get("iteration") and r["_replica"] == found["_replica"]]
        out = {k: v for k, v in found.items() if not k.startswith("_")}
        out.update(key=key, replica=found["_replica"], conversation=conversation(found),
                   episode_rows=same if len(same) > 1 else [])
        return out

    def page(self, *, offset: int = 0, limit: int = 50, iteration: Optional[int] = None,
             env: Optional[str] = None, finish: Optional[str] = None,
             reward_min: Optional[float] = None, reward_max: Optional[float] = None,
             text: Optional[str] = None) -> dict:
        """One page of the filtered samples' summaries, the total that matched and the
        choices each filter has (over every sample)."""
        rows = self.samples()
        q = (text or "").lower()
        hit = [r for r in rows
               if (iteration is None or r.get("iteration") == iteration)
               and (not env or r.get("env") == env)
               and (not finish or r.get("finish_reason") == finish)
               and (reward_min is None or (number(r.get("reward")) or 0.0) >= reward_min)
               and (reward_max is None or (number(r.get("reward")) or 0.0) <= reward_max)
               and (not q or q in r["_search"])]
        rewards = [x for x in (number(r.get("reward")) for r in rows) if x is not None]
        return {"total": len(hit), "all": len(rows), "offset": offset,
                "rows": [summary(r) for r in hit[offset:offset + max(limit, 0)]],
                "facets": {"iterations": sorted({r.get("iteration") for r in rows
                                                 if isinstance(r.get("iteration"), int)}),
                           "envs": sorted({str(r.get("env")) for r in rows}),
                           "finish_reasons": sorted({str(r.get("finish_reason")) for r in rows}),
                           "reward": [min(rewards), max(rewards)] if rewards else None}}

    def run(self, since: int = 0) -> dict:
        """The run view: records from index ``since`` on (the page polls with what it has),
        the evaluations, a few configuration values, which files exist."""
        records = self.metrics()
        cfg = self.config() or {}
        run = cfg.get("run", {}) if isinstance(cfg.get("run"), dict) else {}
        return {"path": str(self.path.resolve()), "total": len(records),
                "since": min(since, len(records)), "records": records[since:],
                "evals": self.evals(), "iterations": run.get("iterations"),
                "env": (cfg.get("env") or {}).get("name") if isinstance(cfg.get("env"), dict)
                else None,
                "algorithm": (cfg.get("algorithm") or {}).get("name")
                if isinstance(cfg.get("algorithm"), dict) else None,
                "has_samples": (self.path / "samples").is_dir(),
                "report": (self.path / "report.png").is_file()}

    def layouts(self) -> dict:
        return layout_view(self.metrics(), self.samples())


def _parse_samples(path: Optional[Path], replica: Optional[int]) -> list[dict]:
    if path is None:
        return []
    try:
        rows = _lines(path.read_text())
    except OSError:
        return []
    for r in rows:
        r["_replica"] = replica
        r["_search"] = "\n".join(str(x) for x in (r.get("text"), *(r.get("actions") or ()),
                                                   json.dumps(r.get("info"), default=str))
                                 ).lower()
    return rows
