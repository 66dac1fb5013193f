"""Named fault points: places in the SGLang path and in split placement's weight handoff where a
test can pause a process and strike.

A fault test must hit a server at an exact moment (while it starts, while the trainer forms the
weight-update group, during a weight push, during a rollout request), on any machine speed.
Sleeping and hoping is not that; this is. Code calls ``fault_point(name, **info)`` at the
moment; it does nothing unless the environment variable ``EARL_FAULT_POINTS`` names a
directory (tests set it; the trainer's ranks inherit it). A test arms a point (``arm``) by
writing ``<dir>/<name>.<id>.arm``: the info values that must match. A point may carry several
arms at once (one per server, say, to strike two servers in the same rollout); the first
process reaching a point whose info matches an arm claims it (an atomic rename, so exactly one
process does),
writes the point's info to ``<dir>/<name>.<id>.hit`` and waits for ``<dir>/<name>.<id>.go``:
the test reads the hit (``wait_hit``: a server's pid, say), kills or stops that server, arms
the next point if any, then lets it go (``release``). Each arm fires once.

Invariants:
- Without ``EARL_FAULT_POINTS`` a fault point is one dictionary lookup: no file is touched.
- A claimed point waits at most ``GO_TIMEOUT_S`` for its go file, then carries on (a test that
  died must not wedge a trainer forever).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ENV = "EARL_FAULT_POINTS"
GO_TIMEOUT_S = 900.0


def fault_point(name: str, **info: Any) -> None:
    """Pause here if a test armed ``name`` with info matching ``info`` (see the module doc)."""
    root = os.environ.get(ENV)
    if not root:
        return
    for arm in sorted(Path(root).glob(f"{name}.*.arm")):
        ident = arm.name[len(name) + 1:-len(".arm")]
        if not ident.isdigit():  # another point's arm ("<name>.<more>.<id>.arm")
            continue
        try:
            want = json.loads(arm.read_text())
        except (OSError, ValueError):  # claimed by another process meanwhile
            continue
        if any(str(info.get(k)) != str(v) for k, v in want.items()):
            continue
        claimed = arm.with_name(f"{name}.{ident}.claimed-{os.getpid()}-{threading.get_ident()}")
        try:
            os.rename(arm, claimed)  # atomic: one claimant per arm
        except OSError:
            continue
        break
    else:
        return
    hit = arm.with_name(f"{name}.{ident}.hit")
    tmp = hit.with_name(f"{hit.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"point": name, "os_pid": os.getpid(), **info}, default=str))
    os.replace(tmp, hit)
    go = arm.with_name(f"{name}.{ident}.go")
    deadline = time.monotonic() + GO_TIMEOUT_S
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def arm(root: Path, name: str, **match: Any) -> str:
    """Test side: arm point ``name`` for the next hit whose info matches ``match``; the arm's
    id (for ``wait_hit`` and ``release``)."""
    ident = f"{time.monotonic_ns()}"
    tmp = Path(root) / f"{name}.{ident}.arm.tmp"
    tmp.write_text(json.dumps(match, default=str))
    os.replace(tmp, Path(root) / f"{name}.{ident}.arm")
    return ident


def wait_hit(root: Path, name: str, ident: str, timeout_s: float,
             alive: Optional[Callable[[], bool]] = None) -> dict:
    """Test side: the info of the hit of arm ``ident``, once a process reached it;
    TimeoutError after ``timeout_s`` or as soon as ``alive()`` turns False."""
    hit = Path(root) / f"{name}.{ident}.hit"
    deadline = time.monotonic() + timeout_s
    while not hit.exists():
        if time.monotonic() > deadline or (alive is not None and not alive()):
            raise TimeoutError(f"fault point {name!r} was never reached")
        time.sleep(0.05)
    return json.loads(hit.read_text())


def release(root: Path, name: str, ident: str) -> None:
    """Test side: let the process paused at arm ``ident`` of ``name`` go on."""
    (Path(root) / f"{name}.{ident}.go").write_text("go")
