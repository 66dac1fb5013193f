"""Progress of a long step a person waits on outside the training loop (conversion, the SmolLM2
fixture): a rich bar on a terminal, plain lines otherwise (a Slurm log, a pipe, CI).

    with ByteProgress("HF -> Megatron-Core", total_bytes) as bar:
        for tensor in ...:
            bar.update(done_bytes)
        bar.phase("merging 3 parts")

    say = phase_printer("smollm2")      # '[smollm2 00:12] dequantising ...' on stderr
    say("dequantising ...")

The training run's own view (rank 0's iterations, the warm start's steps, an evaluation's
episodes) is earl_megatron/trainer/live.py; the SGLang venv build prints the same kind of phase
lines from its shell script (tools/sglang_cpu/setup.sh).

Invariants:
- Off a terminal: a line when the bar starts, at each tenth of its total crossed and when it
  ends ("done: N bytes in S s"), so a log gets about a dozen lines, never one per update and
  never an ANSI escape code. On a terminal: one rich bar (bytes, speed, time left) that is
  cleared at the end, and the same end line.
- ``enabled=False`` prints nothing; ``update`` only stores a number off a terminal unless a
  tenth is crossed, so it may be called per tensor.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

from earl_megatron.plan.specs import human_bytes

TENTHS = 10
"""Plain lines per bar at most, besides its first and last."""


def fmt_elapsed(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60:02d}:{s % 60:02d}"


class ByteProgress:
    """``done`` of ``total`` bytes of a step called ``what`` (module doc). ``console``: a rich
    Console to draw on (default: stdout, whose ``is_terminal`` picks the bar or the lines)."""

    def __init__(self, what: str, total: int, *, enabled: bool = True, console=None) -> None:
        self.what, self.total, self.enabled = what, int(total), enabled
        self.done = 0
        self._console = console
        self._bar = None            # rich.progress.Progress on a terminal
        self._task = None
        self._tenth = -1            # the last tenth printed off a terminal
        self._t0 = 0.0

    def __enter__(self) -> "ByteProgress":
        if not self.enabled:
            return self
        from rich.console import Console
        self._console = self._console or Console()
        self._t0 = time.perf_counter()
        if self._console.is_terminal and not self._console.is_dumb_terminal:
            from rich.progress import (BarColumn, DownloadColumn, Progress,
                                       TimeRemainingColumn, TransferSpeedColumn)
            self._bar = Progress("[bold]" + self.what, BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=self._console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total)
        else:
            self._line(f"{human_bytes(self.total)} to go")
            self._tenth = 0
        return self

    def update(self, done: int) -> None:
        """``done`` bytes of ``total`` so far."""
        self.done = int(done)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            return
        tenth = TENTHS * self.done // self.total if self.total else TENTHS
        if tenth > self._tenth and self.done < self.total:
            self._tenth = tenth
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / self.done * (self.total - self.done) if self.done else None
            self._line(f"{human_bytes(self.done)} of {human_bytes(self.total)} "
                       f"({100 * self.done // self.total}%), elapsed {fmt_elapsed(elapsed)}, "
                       f"eta {'--:--' if eta is None else fmt_elapsed(eta)}")

    def phase(self, text: str) -> None:
        """A line saying what the step does now (above the bar on a terminal)."""
        if self.enabled:
            self._line(f"{text} (elapsed {fmt_elapsed(time.perf_counter() - self._t0)})")

    def __exit__(self, exc_type, *exc) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if exc_type is None:
            seconds = time.perf_counter() - self._t0
            self._line(f"done: {self.done} bytes in {seconds:.1f} s "
                       f"({human_bytes(self.done / max(seconds, 1e-9))}/s)")

    def _line(self, text: str) -> None:
        line = f"{self.what}: {text}"
        if self._bar is not None:
            from rich.text import Text
            self._bar.console.print(Text(line))
        else:
            f = self._console.file
            f.write(line + "\n")
            f.flush()


def phase_printer(name: str, file: Optional[TextIO] = None) -> Callable[[str], None]:
    """``say(text)`` prints '[name mm:ss] text' (the time since this call) and flushes: one line
    per phase of a step whose parts report no progress of their own. Default file: stderr
    (stdout stays the step's result, e.g. tools/smollm2.py's directory)."""
    t0 = time.perf_counter()

    def say(text: str) -> None:
        out = file or sys.stderr
        out.write(f"[{name} {fmt_elapsed(time.perf_counter() - t0)}] {text}\n")
        out.flush()
    return say
