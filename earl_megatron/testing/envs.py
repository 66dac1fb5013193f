"""Environments for tests that need a stage to last until an event, by construction.

A test of stopping (SIGTERM, a stop file, Slurm preemption) needs the request to land inside a
rollout, whatever the machine's speed: on an idle host an iteration of the tiny model takes
0.3 s, on a loaded one a minute. Timing the request after a sleep decides which stage it lands
in by luck. ``held_connect_four`` decides it by construction:

    env.name=earl_megatron.testing.envs:held_connect_four
    env.kwargs.hold_when=<run>/metrics.jsonl      # hold once it has a line: iteration 1 on
    env.kwargs.hold_after_stop_s=35               # optional: a stop that takes 35 s more
    env.kwargs.release_when=<path>                # optional: never hold once it exists
    env.kwargs.holding_file=<path>                # optional: created when a step starts holding

- It plays Connect Four exactly as ``connect_four`` with the same other kwargs (same seeds, same
  moves, same rewards), so its metrics equal a plain run's.
- Once the file ``hold_when`` holds at least ``hold_lines`` lines (default 1), every ``step``
  first waits until this process has been told to stop (``earl_megatron.trainer.stop.
  told_to_stop``: a SIGTERM or a ``requested`` stop file), then ``hold_after_stop_s`` seconds
  more, then plays the step. With ``hold_when`` the run's metrics file (rank 0 appends iteration
  0's line before the all-reduce every rank passes to start iteration 1), iteration 0 completes
  and iteration 1's rollout can never complete before the request: the stop lands there, and
  the last completed iteration is 0, on every machine.
- Once the path ``release_when`` exists, the environment never holds: a requeued or resumed run
  with the same configuration plays through (the test creates it after the stop it wanted).
- ``holding_file``, when given, is created as a step starts to hold: a test that needs its
  request to land *inside* the held rollout (not at the stage boundary just before it, where
  the trainer also looks) waits for this file instead of for ``hold_when``.
- A hold that outlasts ``hold_limit_s`` (default 600 s) raises ``HoldTimeout``: a test whose
  request never comes fails with that message instead of hanging.

A test knob, never a production path: nothing outside tests names this module.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from earl_megatron.envs.base import StepResult
from earl_megatron.envs.openspiel_games import OpenSpielEnv

POLL_S = 0.01


class HoldTimeout(RuntimeError):
    """The held environment was never told to stop within its limit."""


class HeldEnv(OpenSpielEnv):
    """Connect Four that holds every step once ``hold_when`` exists, until told to stop."""

    def __init__(self, hold_when: str, hold_lines: int = 1, hold_after_stop_s: float = 0.0,
                 hold_limit_s: float = 600.0, release_when: Optional[str] = None,
                 holding_file: Optional[str] = None, **kwargs):
        super().__init__(game="connect_four", **kwargs)
        if not hold_when:
            raise ValueError("held_connect_four needs hold_when=<path> (the event that starts "
                             "the hold, e.g. the run's metrics.jsonl)")
        if int(hold_lines) < 1 or not hold_after_stop_s >= 0 or not hold_limit_s > 0:
            raise ValueError(f"hold_lines={hold_lines} must be >= 1, hold_after_stop_s="
                             f"{hold_after_stop_s} >= 0 and hold_limit_s={hold_limit_s} > 0")
        self.hold_when = str(hold_when)
        self.hold_lines = int(hold_lines)
        self.release_when = str(release_when) if release_when else None
        self.hold_after_stop_s = float(hold_after_stop_s)
        self.hold_limit_s = float(hold_limit_s)
        self.holding_file = str(holding_file) if holding_file else None

    def _step(self, action: str) -> StepResult:
        released = self.release_when is not None and os.path.exists(self.release_when)
        if not released and self._lines() >= self.hold_lines:
            self._hold()
        return super()._step(action)

    def _lines(self) -> int:
        try:
            with open(self.hold_when, "rb") as f:
                return f.read().count(b"\n")
        except OSError:
            return 0

    def _hold(self) -> None:
        from earl_megatron.trainer.stop import told_to_stop

        deadline = time.monotonic() + self.hold_limit_s
        if self.holding_file is not None and not os.path.exists(self.holding_file):
            with open(self.holding_file, "a"):
                pass
        while not told_to_stop():
            if time.monotonic() > deadline:
                raise HoldTimeout(f"held_connect_four: {self.hold_when} has {self.hold_lines} "
                                  "line(s) but this process was not told to stop within "
                                  f"{self.hold_limit_s:.0f} s (send SIGTERM or write "
                                  "'requested' to the stop file)")
            time.sleep(POLL_S)
        time.sleep(self.hold_after_stop_s)


def held_connect_four(**kwargs) -> HeldEnv:
    return HeldEnv(**kwargs)
