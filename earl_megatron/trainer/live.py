"""What a person watching a training run sees while it runs (rank 0).

    view = LiveView(total=cfg.run.iterations, start=start, enabled=rank == 0)
    with view:                      # start() ... close()
        view.message("resumed from ...")
        for it in range(start, total):
            ...
            view.update(rec)        # once per iteration, the record written to metrics.jsonl

On a terminal: a rich Live display, a progress line (iterations done/total, elapsed, ETA) over
a table of the last 10 iterations. Off a terminal (piped to a file, Slurm, `make demo > log`):
a header, then one fixed-width plain line per iteration with the same columns, never an ANSI
escape code. Columns: iteration; per stage (rollout, logprob when present, train) its layout,
its seconds and its predicted memory in GiB (auto layouts only); context mean/max; reward;
win rate; illegal and unparsable rates; what the update did (``TRAIN_COLUMNS``: gradient norm
before clipping, policy entropy, KL to the reference, fraction of policy tokens whose ratio was
clipped, mean policy ratio pi/pi_old: a normalised policy-gradient loss is ~0 by construction and
says nothing, so it is in metrics.jsonl and the trackers only); seconds per iteration; ETA.
On a terminal the latest sample (trainer/samples.py: one episode decoded, as the model saw it)
shows under the table: its reward, finish reason and flags, then the end of its text
(``SAMPLE_LINES`` lines at most, each cut to the console's width). Off a terminal the samples are
in <output_dir>/samples only (the plain lines stay one per iteration).

A long step between iterations reports its progress with ``progress(title, done, total, unit,
detail)``: the warm start (steps) and each evaluation (rank 0's replica's episodes, the opponent
and mode in ``detail``). On a terminal it is a bar under the iteration line, with its own
elapsed time and ETA (cleared by the next iteration's record); off a terminal a line when the
step or its detail changes and at each quarter of ``total`` (``progress_line``), so a log gets
a handful of lines per step, never one per call.

Invariants:
- metrics.jsonl stays the record; this module only displays it (the trackers of run.loggers,
  TensorBoard among them, are earl_megatron/trackers).
- enabled=False makes every method a no-op (ranks other than 0 construct it that way).
- The constructor has no side effects; start() picks the console and starts the display;
  close() stops it and is safe to call twice.
- Rendering is cheap: the table is rebuilt once per update(), the display refreshes once a
  second, and ETA is wall-clock mean seconds per iteration since start() times what is left.
  progress() only stores a few numbers (on a terminal) or compares a quarter (off one); a
  step's ETA is its mean seconds per unit since its first report times what is left.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional

from earl_megatron.stages import STAGE_NAMES

ROWS = 10
LAYOUT_W = 13                      # "TP2xPP2xDP16"; longer layouts push the line right
STAGE_W = LAYOUT_W + 1 + 7 + 1 + 6
TRAIN_COLUMNS = (("grad_norm", "gnorm", ".3f", 6), ("entropy", "ent", ".3f", 6),
                 ("kl", "kl", "+.4f", 8), ("clip_fraction", "clip", ".3f", 5),
                 ("ratio_mean", "ratio", ".4f", 6))
"""(metrics key, header, format, width): a key a record lacks shows as '-'."""
SAMPLE_LINES = 8
"""Lines of the latest sample's text the live display shows (its last ones: the answer)."""


# ---------------------------------------------------------------------------- pure formatting
def stages_of(rec: dict) -> list[str]:
    """The stages a record has layouts for, rollout -> logprob -> train, then any others."""
    lay = rec.get("layouts", {})
    return [s for s in STAGE_NAMES if s in lay] + sorted(s for s in lay if s not in STAGE_NAMES)


def stage_cell(rec: dict, stage: str) -> str:
    """'TP2xDP2      12.3s  5.1G': layout, stage seconds, predicted GiB (blank when unknown)."""
    layout = rec.get("layouts", {}).get(stage, "-")
    sec = rec.get("seconds", {}).get(stage)
    mem = rec.get("predicted_memory_gb", {}).get(stage)
    sec_s = f"{sec:6.1f}s" if isinstance(sec, (int, float)) else " " * 7
    mem_s = f"{mem:5.1f}G" if isinstance(mem, (int, float)) else " " * 6
    return f"{layout:<{LAYOUT_W}} {sec_s} {mem_s}"


def _num(rec: dict, key: str, fmt: str, width: int) -> str:
    v = rec.get(key)
    return format(v, fmt).rjust(width) if isinstance(v, (int, float)) else "-".rjust(width)


def fmt_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "--:--"
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def row_cells(rec: dict, stages: list[str], eta: Optional[float] = None) -> list[str]:
    """One iteration's columns (shared by the table and the plain line)."""
    ctx = (f"{rec['mean_context']:.0f}/{rec['max_context']:.0f}"
           if isinstance(rec.get("mean_context"), (int, float))
           and isinstance(rec.get("max_context"), (int, float)) else "-")
    return ([f"{rec.get('iteration', '-'):>5}"] + [stage_cell(rec, s) for s in stages]
            + [f"{ctx:>12}", _num(rec, "reward", "+.3f", 7), _num(rec, "win_rate", ".2f", 5),
               _num(rec, "illegal_rate", ".2f", 5), _num(rec, "unparsable_rate", ".2f", 5)]
            + [_num(rec, key, fmt, w) for key, _, fmt, w in TRAIN_COLUMNS]
            + [_num(rec.get("seconds", {}), "total", ".1f", 6), f"{fmt_duration(eta):>8}"])


def header_cells(stages: list[str]) -> list[str]:
    return ([f"{'iter':>5}"] + [f"{s:<{STAGE_W}}" for s in stages]
            + [f"{'ctx mean/max':>12}", f"{'reward':>7}", f"{'win':>5}", f"{'ill':>5}",
               f"{'unp':>5}"] + [f"{h:>{w}}" for _, h, _, w in TRAIN_COLUMNS]
            + [f"{'s/it':>6}", f"{'eta':>8}"])


def sample_lines(sample: dict, width: int = 100, lines: int = SAMPLE_LINES) -> list[str]:
    """The live display's view of one sample (trainer/samples.py's dict): a heading (iteration,
    sample id, reward, finish reason, the info flags that are set), then the last ``lines``
    lines of its text, each cut to ``width`` characters ('...' marks a cut)."""
    flags = [k for k, v in (sample.get("info") or {}).items() if v is True]
    head = (f"sample {sample.get('sample', '-')} of iteration {sample.get('iteration', '-')}: "
            f"reward {sample.get('reward', float('nan')):+.3f}, "
            f"{sample.get('finish_reason', '-')}, {sample.get('turns', '-')} turns"
            + (f", {' '.join(flags)}" if flags else ""))
    text = str(sample.get("text", "")).splitlines() or [""]
    body = (["..."] if len(text) > lines else []) + text[-lines:]
    return [_cut(line, width) for line in [head, *body]]


def progress_line(task: dict, now: float) -> str:
    """'warm start: 50/200 steps (25%), elapsed 00:30, eta 01:30' (``detail`` after the title;
    a total of 0 is unknown: no percentage, no ETA)."""
    done, total = task["done"], task["total"]
    count = (f"{done}/{total} {task['unit']} ({100 * done // total}%)" if total
             else f"{done} {task['unit']}")
    head = task["title"] + (f" ({task['detail']})" if task["detail"] else "")
    return (f"{head}: {count}, elapsed {fmt_duration(now - task['t0'])}, "
            f"eta {fmt_duration(task_eta(task, now))}")


def task_eta(task: dict, now: float) -> Optional[float]:
    """Seconds left of a step: its mean seconds per unit since its first report times what is
    left; None before a unit is done or when the total is unknown."""
    ran = task["done"] - task["done0"]
    if not task["total"] or ran <= 0:
        return None
    return (now - task["t0"]) / ran * max(task["total"] - task["done"], 0)


def _cut(line: str, width: int) -> str:
    return line if len(line) <= width else line[:max(width - 3, 0)] + "..."


# ---------------------------------------------------------------------------- the view
class LiveView:
    """Progress display for rank 0 (rich Live on a terminal, plain lines otherwise).

    total: iterations of the whole run (cfg.run.iterations); start: first iteration of this
    process (> 0 after a resume); enabled: False -> silent no-op; live: False -> plain lines
    even on a terminal; console: a rich Console to draw on (default: stdout, chosen in start()).
    """

    def __init__(self, total: int, start: int = 0, *, enabled: bool = True, live: bool = True,
                 console=None) -> None:
        self.total, self.start_iteration = total, start
        self.enabled, self.want_live = enabled, live
        self._console = console
        self._live = None           # rich.live.Live while the display runs
        self._rows: deque = deque(maxlen=ROWS)
        self._table = None
        self._stages: Optional[list[str]] = None   # columns of the last plain header
        self._done = start
        self._sample: Optional[dict] = None         # the latest sample, shown on a terminal
        self._task: Optional[dict] = None           # the long step in progress (progress())
        self._t0: Optional[float] = None
        self._started = False

    # -- lifecycle
    def start(self) -> "LiveView":
        if not self.enabled or self._started:
            return self
        self._started = True
        self._t0 = time.perf_counter()
        if self._console is None:
            from rich.console import Console
            self._console = Console()
        if self.want_live and self._console.is_terminal and not self._console.is_dumb_terminal:
            from rich.live import Live
            self._live = Live(console=self._console, get_renderable=self._render,
                              refresh_per_second=1, transient=False)
            self._live.start()
        return self

    def close(self) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None

    def __enter__(self) -> "LiveView":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- events
    def update(self, rec: dict) -> None:
        """Show one iteration's record (the dict written to metrics.jsonl)."""
        if not self.enabled:
            return
        if not self._started:
            self.start()
        self._done = rec.get("iteration", self._done) + 1
        self._task = None           # the step before this record is over
        eta = self.eta()
        stages = stages_of(rec)
        if self._live is not None:
            self._rows.append(rec)
            self._table = self._build_table()
            self._live.refresh()
        else:
            if stages != self._stages:
                self._stages = stages
                self._write("  ".join(header_cells(stages)))
            self._write("  ".join(row_cells(rec, stages, eta)))

    def sample(self, sample: dict) -> None:
        """The latest decoded episode (trainer/samples.py), shown under the live table; off a
        terminal nothing is printed (it is in <output_dir>/samples)."""
        if not self.enabled:
            return
        self._sample = sample
        if self._live is not None:
            self._live.refresh()

    def message(self, text: str) -> None:
        """A free text line (resume, evaluation results), printed above the live display."""
        if not self.enabled:
            return
        if not self._started:
            self.start()
        if self._live is not None:
            from rich.text import Text
            self._live.console.print(Text(text))
        else:
            self._write(text)

    def progress(self, title: str, done: int, total: int, unit: str = "",
                 detail: str = "") -> None:
        """A long step outside the iterations: ``done`` of ``total`` ``unit`` (total 0:
        unknown). A new ``title``, or ``done`` going back, starts a new step (its clock and
        ETA); ``detail`` says what it is doing now (an evaluation's opponent and mode)."""
        if not self.enabled:
            return
        if not self._started:
            self.start()
        now = time.perf_counter()
        task = self._task
        if task is None or task["title"] != title or done < task["done"]:
            task = self._task = {"title": title, "t0": now, "done0": done, "printed": None}
        task.update(done=done, total=total, unit=unit, detail=detail)
        if self._live is not None:
            return          # drawn by _render at the display's next refresh
        mark = (detail, 4 * done // total if total else 0)
        if mark != task["printed"]:
            task["printed"] = mark
            self._write(progress_line(task, now))

    def progress_eta(self) -> Optional[float]:
        """Seconds left of the long step in progress (None: none, or not known yet)."""
        return None if self._task is None else task_eta(self._task, time.perf_counter())

    def eta(self) -> Optional[float]:
        """Seconds left: wall-clock mean per iteration since start() times iterations left."""
        ran = self._done - self.start_iteration
        if self._t0 is None or ran <= 0:
            return None
        return (time.perf_counter() - self._t0) / ran * max(self.total - self._done, 0)

    # -- internals
    def _write(self, line: str) -> None:
        f = self._console.file
        f.write(line + "\n")
        f.flush()

    def _build_table(self):
        from rich.table import Table
        stages: list[str] = []
        for rec in self._rows:
            stages += [s for s in stages_of(rec) if s not in stages]
        stages = [s for s in STAGE_NAMES if s in stages] + [s for s in stages
                                                            if s not in STAGE_NAMES]
        table = Table(box=None, pad_edge=False, header_style="bold")
        # the progress line above carries the ETA: drop the per-row column
        for name in header_cells(stages)[:-1]:
            table.add_column(name.strip(), justify="left" if name.strip() in stages else "right",
                             no_wrap=True)
        for rec in self._rows:
            table.add_row(*(c.strip() for c in row_cells(rec, stages)[:-1]))
        return table

    def _render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        elapsed = None if self._t0 is None else time.perf_counter() - self._t0
        head = Table.grid(padding=(0, 1))
        head.add_row(f"iteration {self._done}/{self.total}",
                     ProgressBar(total=max(self.total, 1), completed=self._done, width=40),
                     f"elapsed {fmt_duration(elapsed)}", f"eta {fmt_duration(self.eta())}")
        task = self._task
        if task is not None:
            now = time.perf_counter()
            count = f"{task['done']}/{task['total']}" if task["total"] else f"{task['done']}"
            head.add_row(f"{task['title']} {count} {task['unit']}".rstrip(),
                         ProgressBar(total=max(task["total"], 1), completed=task["done"],
                                     width=40),
                         f"elapsed {fmt_duration(now - task['t0'])}",
                         f"eta {fmt_duration(task_eta(task, now))}", task["detail"])
        parts = [head] + ([] if self._table is None else [self._table])
        if self._sample is not None:
            from rich.text import Text
            width = max(self._console.width - 2, 20)
            lines = sample_lines(self._sample, width)
            parts.append(Text("\n".join(lines), no_wrap=True, overflow="ellipsis"))
        return parts[0] if len(parts) == 1 else Group(*parts)
