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
def striking(points: Path, plan: list, *more: list):
    """Strike ``plan`` while the body runs (the ranks must inherit ``fault_points.ENV`` =
    ``points``); yields a list that holds the strikes made, (point, action, pid), once the body
    is done, and checks then that every one was made, in order. Each of ``more`` is another
    plan struck beside it by a striker of its own (its first point armed at once): strikes on
    two servers in one stage overlap their restarts instead of queueing them."""
    plans = (plan, *more)
    done, struck, errors = threading.Event(), [[] for _ in plans], []
    strikers = [threading.Thread(target=_strike, args=(points, p, done, made, errors),
                                 daemon=True) for p, made in zip(plans, struck)]
    for striker in strikers:
        striker.start()
    made: list = []
    try:
        yield made
    finally:
        done.set()
        for striker in strikers:
            striker.join(timeout=30)
        made.extend(x for each in struck for x in each)
    assert not errors, errors
    for p, each in zip(plans, struck):
        assert [s[:2] for s in each] == [(n, a.__name__) for n, _, a in p], each
