"""Run a switch's transfers: rounds of messages over batched isend/irecv or shared memory.

A ``Message`` is ``(src, dst, nbytes, key)``, identical on every rank; on its two ends ``key``
resolves to tensors: ``outgoing(msg)`` on the sender and ``incoming(msg)`` on the receiver
return views (one dtype per message) whose row-major concatenation is the payload. Both ends
list the same elements in the same order, possibly cut into different views.

Invariants:
- every rank walks the same rounds in the same order, so both ends of a message post it in the
  same round and position (gloo pairs isend/irecv by order per peer);
- per round no rank stages more than the round's bytes: a non-contiguous send is packed into one
  buffer, a non-contiguous receive lands in one and is scattered; contiguous views are sent and
  received in place (p2p), or copied straight out of the sender's shared outbox (shm);
- with shared memory (runtime/shm.py) a round is: senders write, fence, receivers read,
  fence; every message's slot (64-byte aligned, in round order per sender) is computed from
  ``nbytes`` alike on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from earl_megatron.runtime.shm import SharedOutboxError, SharedOutboxes, shared_memory_world, \
    shared_outboxes

TRANSPORTS = ("auto", "p2p", "shm")
SLOT_ALIGN = 64
"""Byte alignment of each message in a shared outbox (any dtype can view it; cache lines)."""


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    nbytes: int
    key: Any


Views = Callable[[Message], list[torch.Tensor]]


@dataclass
class Traffic:
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    transport: str = ""


def open_outboxes(transport: str, rounds: list[list[Message]],
                  on_cpu: bool) -> Optional[SharedOutboxes]:
    """Shared outboxes big enough for the busiest sender's round, or None for isend/irecv.

    Collective (all ranks pass the same arguments). ``transport``: "auto" uses shared memory
    where it applies (gloo, CPU tensors, one host), "p2p" never, "shm" always (an error where it
    does not apply)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "p2p" or not (on_cpu and shared_memory_world()):
        if transport == "shm":
            raise ValueError("transport='shm' needs a gloo world of CPU tensors on one host "
                             "sharing /dev/shm; use transport='auto' or 'p2p'")
        return None
    capacity = max((max(_slots(rnd)[1].values(), default=0) for rnd in rounds), default=0)
    if capacity == 0:
        return None
    try:
        return shared_outboxes(capacity)
    except SharedOutboxError:
        if transport == "shm":
            raise
        return None   # every rank agreed on the failure: all fall back to isend/irecv


def run_rounds(rounds: list[list[Message]], me: int, outgoing: Views, incoming: Views,
               boxes: Optional[SharedOutboxes], traffic: Traffic, group=None) -> None:
    """Run ``rounds``; ``me`` and every message's ranks are global ranks. ``group``: the
    process group of the isend/irecv (None: the world; torch maps the peers into it). Shared
    outboxes fence with world barriers, so they take no group."""
    if group is not None and boxes is not None:
        raise ValueError("run_rounds: shared outboxes fence on the world group; pass boxes=None "
                         "to run on a group of its own")
    traffic.transport = "p2p" if boxes is None else "shm"
    for rnd in rounds:
        if boxes is None:
            _p2p_round(rnd, me, outgoing, incoming, traffic, group)
        else:
            _shared_round(rnd, me, outgoing, incoming, boxes, traffic)
        traffic.rounds += 1


def pack(views: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``views`` one after another into the flat tensor ``out``."""
    at = 0
    for v in views:
        out[at:at + v.numel()].view(v.shape).copy_(v)
        at += v.numel()
    return out


def unpack(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Scatter the flat tensor ``flat`` into ``views``, in order."""
    at = 0
    for v in views:
        v.copy_(flat[at:at + v.numel()].view(v.shape))
        at += v.numel()


def _numel(views: list[torch.Tensor]) -> int:
    return sum(v.numel() for v in views)


def _p2p_round(rnd, me: int, outgoing: Views, incoming: Views, traffic: Traffic,
               group=None) -> None:
    ops, landings = [], []
    for m in rnd:
        if m.src == me:
            views = outgoing(m)
            buf = views[0] if len(views) == 1 and views[0].is_contiguous() else pack(
                views, torch.empty(_numel(views), dtype=views[0].dtype, device=views[0].device))
            ops.append(dist.P2POp(dist.isend, buf, m.dst, group=group))
            traffic.bytes_sent += m.nbytes
        elif m.dst == me:
            views = incoming(m)
            if len(views) == 1 and views[0].is_contiguous():
                buf = views[0]
            else:
                buf = torch.empty(_numel(views), dtype=views[0].dtype, device=views[0].device)
                landings.append((buf, views))
            ops.append(dist.P2POp(dist.irecv, buf, m.src, group=group))
            traffic.bytes_received += m.nbytes
    if not ops:
        return
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for buf, views in landings:
        unpack(buf, views)


def _slots(rnd) -> tuple[list[int], dict[int, int]]:
    """Byte offset of each message in its sender's outbox, and each sender's bytes used."""
    offsets, used = [], {}
    for m in rnd:
        at = -(-used.get(m.src, 0) // SLOT_ALIGN) * SLOT_ALIGN
        offsets.append(at)
        used[m.src] = at + m.nbytes
    return offsets, used


def _shared_round(rnd, me: int, outgoing: Views, incoming: Views, boxes: SharedOutboxes,
                  traffic: Traffic) -> None:
    offsets, _ = _slots(rnd)
    out = boxes.outbox()
    for m, at in zip(rnd, offsets):
        if m.src == me:
            views = outgoing(m)
            pack(views, out[at:at + m.nbytes].view(views[0].dtype))
            traffic.bytes_sent += m.nbytes
    boxes.fence()
    for m, at in zip(rnd, offsets):
        if m.dst == me:
            views = incoming(m)
            unpack(boxes.inbox(m.src)[at:at + m.nbytes].view(views[0].dtype), views)
            traffic.bytes_received += m.nbytes
    boxes.fence()   # nobody writes its outbox again before every peer has read it
