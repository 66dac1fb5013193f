"""Fault strikes on SGLang servers for the trainer tests (tests/sglang/test_trainer_sglang.py,
test_split_sglang.py): a plan of (fault point, match, action) struck in order at named fault
points (earl_megatron/runtime/fault_points.py), never after a sleep."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

from earl_megatron.runtime import fault_points


def kill(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)  # the process group this run started


def stall(pid: int) -> None:
    """Freeze every process of the server's group but its leader (the HTTP front end): the
    port still accepts requests, nothing answers them."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pid:
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[2]) == pid:  # field 5: the pgid
                os.kill(int(entry), signal.SIGSTOP)


def _strike(points: Path, plan: list, done: threading.Event, struck: list, errors: list):
    """Arm each point of ``plan`` in turn; strike when it is reached. The next point is armed
    before the paused process is released, so the order never depends on timing."""
    try:
        name, match, _ = plan[0]
        ident = fault_points.arm(points, name, **match)
        for k, (name, match, action) in enumerate(plan):
            hit = fault_points.wait_hit(points, name, ident, timeout_s=2000,
                                        alive=lambda: not done.is_set())
            action(int(hit["pid"]))
            struck.append((name, action.__name__, int(hit["pid"])))
            this = ident
            if k + 1 < len(plan):
                ident = fault_points.arm(points, plan[k + 1][0], **plan[k + 1][1])
            fault_points.release(points, name, this)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


@contextlib.contextmanager
def striking(points: Path, plan: list):
    """Strike ``plan`` while the body runs; yields the strikes made, (point, action, pid), and
    checks on exit that every one was made, in order (the ranks must inherit
    ``fault_points.ENV`` = ``points``)."""
    done, struck, errors = threading.Event(), [], []
    striker = threading.Thread(target=_strike, args=(points, plan, done, struck, errors),
                               daemon=True)
    striker.start()
    try:
        yield struck
    finally:
        done.set()
        striker.join(timeout=30)
    assert not errors, errors
    assert [s[:2] for s in struck] == [(p, a.__name__) for p, _, a in plan], struck
