"""Tearing down a cached layout's groups: destroyed on every rank alike, freed off the caller.

Used by runtime/groups.py's cache. ``deregister`` destroys groups (torch forgets them: unusable
from then on) after a barrier on the world; ``release_later`` drops the last references on a
helper thread, since gloo's ProcessGroup destructor sleeps (each connection's close waits for
its device loop's next 10 ms epoll tick, ~30 ms a group of 4).

Invariants:
- ``deregister`` is called on every rank at the same point of the call sequence (the cache's
  invariant), so its barrier on the world, never destroyed here, is matched on every rank.
- At most ``_MAX_RELEASING`` release threads are in flight (a third waits for the oldest), which
  bounds the fds and threads of groups not yet freed; ``wait_released`` joins them all.
"""

from __future__ import annotations

import threading

import torch.distributed as dist


def deregister(pgs: list) -> None:
    """Destroy ``pgs`` (each once) on every rank at the same point of the call sequence."""
    # Every rank must have finished connecting these groups before any rank closes them: gloo's
    # connectFullMesh returns on the active side of a pair once it wrote its handshake, and a
    # close (a reset) before the passive peer accepted it fails that peer with "Gloo
    # connectFullMesh failed ... Connection closed by peer" (seen under CPU load, 3 runs in 4
    # with two busy loops beside the 100-rebuild test). Every rank deregisters at the same
    # point of the call sequence (the cache invariant: every rank evicts the same keys, a
    # pool's non-members too, whose entry holds no group), so this barrier on the world, never
    # destroyed here, is matched on every rank.
    dist.barrier()
    for g in pgs:   # each once: a cache entry's groups are distinct and its own
        dist.destroy_process_group(g)


_RELEASING: list[threading.Thread] = []
_MAX_RELEASING = 2


def release_later(pgs: list) -> None:
    """Drop ``pgs`` (the caller's last references to these groups) on a helper thread."""
    _RELEASING[:] = [t for t in _RELEASING if t.is_alive()]
    while len(_RELEASING) >= _MAX_RELEASING:   # bound the fds and threads in flight
        _RELEASING.pop(0).join()
    # not a daemon: interpreter exit joins it rather than freezing it inside a destructor
    t = threading.Thread(target=pgs.clear, name="earl-release-groups")
    t.start()
    _RELEASING.append(t)


def wait_released() -> None:
    """Block until groups handed to helper threads are destroyed (fds and threads freed)."""
    while _RELEASING:
        _RELEASING.pop(0).join()
