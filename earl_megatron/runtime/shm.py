"""Same-host byte exchange through shared memory: the switcher's transport between gloo ranks.

gloo moves every byte between two ranks of one host through loopback TCP: a copy into the
kernel, a copy out, and gloo's per-pair threads in between (~2 GB/s on the 2-core CI machine).
Ranks that share a host (and a ``/dev/shm``) can instead exchange bytes through one shared
file per rank: the sender writes its outgoing slices into its *outbox*, every rank waits at a
fence, and each receiver copies its slices straight out of the sender's outbox into place.

``SharedOutboxes(capacity)`` is collective over the world:
- rank 0 broadcasts a job token (its pid and 48 random bits); every rank creates
  ``/dev/shm/earl-outbox-<token>-<rank>`` of ``capacity`` bytes, reserved with
  ``posix_fallocate`` (a tmpfs that is too small fails here with ENOSPC, never later with
  SIGBUS), and opens every peer's;
- each rank unlinks its own file as soon as every peer has opened it, so nothing is left in
  ``/dev/shm`` after the constructor returns, whatever happens later (the open descriptors keep
  the memory until ``close()``); a peer's outbox is mapped when first read;
- if any rank fails to create or open, every rank gets ``SharedOutboxError`` (the decision is
  all-reduced) and its file is gone: callers fall back to point-to-point ops;
- if setup breaks instead (a peer raises or dies mid-setup, so a collective fails), each
  surviving rank unlinks, in a ``finally``, its own file and every peer's: the names follow from
  the token, so even a peer killed between creating its file and unlinking it leaves nothing in
  ``/dev/shm``, and the survivor's error propagates. The probe file is unlinked the same way.

``shared_memory_world()`` says, once per process (collective on the first call), whether this
transport applies: the default backend is gloo and every rank can read a file rank 0 wrote in
``/dev/shm`` (one host, one ``/dev/shm`` namespace). NCCL worlds and multi-host gloo worlds keep
``torch.distributed.batch_isend_irecv``.

A round (runtime/transport.py): every sender writes, ``fence()``, every receiver reads,
``fence()``; the second fence keeps a sender from overwriting what a peer has not read yet.
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.runtime.dist import gloo_only

SHM_DIR = "/dev/shm"
_SAME_HOST: Optional[bool] = None


class SharedOutboxError(RuntimeError):
    """Some rank could not create or map its shared outbox; use point-to-point ops instead."""


def shared_memory_world() -> bool:
    """Whether every rank can exchange bytes through ``/dev/shm`` (collective on first call)."""
    global _SAME_HOST
    if _SAME_HOST is None:
        _SAME_HOST = gloo_only() and _probe()
    return _SAME_HOST


def _probe() -> bool:
    token = secrets.token_hex(8)
    path = os.path.join(SHM_DIR, f"earl-probe-{os.getpid()}-{token}")
    shared = [path if dist.get_rank() == 0 else None]
    written = False
    try:
        if dist.get_rank() == 0:
            try:
                with open(path, "w") as f:
                    f.write(token)
                written = True
            except OSError:
                shared = [None]
        dist.broadcast_object_list(shared, src=0)
        ok = shared[0] is not None
        if ok:
            try:
                with open(shared[0]) as f:
                    ok = f.read() == os.path.basename(shared[0]).rsplit("-", 1)[1]
            except OSError:
                ok = False
        agree = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    finally:   # also when a peer dies mid-probe and a collective raises
        if written:
            _unlink(path)
    return bool(agree.item())


class SharedOutboxes:
    """One shared outbox of ``capacity`` bytes per rank; a peer's is mapped on first read."""

    def __init__(self, capacity: int):
        me, world = dist.get_rank(), dist.get_world_size()
        capacity = max(1, int(capacity))
        token = [f"{os.getpid()}-{secrets.token_hex(6)}" if me == 0 else None]
        dist.broadcast_object_list(token, src=0)   # nothing exists yet if this one fails
        paths = [outbox_path(token[0], r) for r in range(world)]
        fds: dict[int, int] = {}
        done = False
        try:
            created = _create(paths[me], capacity)
            made: list = [None] * world
            dist.all_gather_object(made, created)
            ok = all(made)
            if ok:   # open every peer's file now (it is unlinked below); map it when first read
                try:
                    for r, n in enumerate(paths):
                        fds[r] = os.open(n, os.O_RDWR)
                except OSError:
                    ok = False
            agree = torch.tensor([1 if ok else 0], dtype=torch.int64)
            dist.all_reduce(agree, op=dist.ReduceOp.MIN)   # every rank has opened (or given up)
            done = True
        finally:
            # normally only our own file is left to unlink (peers unlink theirs); when a
            # collective broke, a peer may be dead with its file still there: remove every name
            for r, n in enumerate(paths):
                if r == me or not done:
                    _unlink(n)
            if not done:
                for fd in fds.values():
                    os.close(fd)
        self.capacity = capacity
        self._fds = fds
        self._maps: dict[int, mmap.mmap] = {}
        self._boxes: dict[int, torch.Tensor] = {}
        self._me = me
        if not agree.item():
            self.close()
            raise SharedOutboxError(f"could not create or open {capacity} bytes of shared "
                                    f"memory in {SHM_DIR} on every rank")
        self.outbox()

    def outbox(self) -> torch.Tensor:
        """This rank's outbox (uint8), which every peer reads after the next ``fence()``."""
        return self.inbox(self._me)

    def inbox(self, rank: int) -> torch.Tensor:
        """``rank``'s outbox, as mapped here (read it only between two fences). Mapped with its
        page tables filled at once (MAP_POPULATE) rather than by one fault per 4 KiB page; only
        the peers a rank actually reads from are mapped."""
        if rank not in self._boxes:
            m = mmap.mmap(self._fds[rank], self.capacity,
                          flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self._maps[rank] = m
            self._boxes[rank] = torch.frombuffer(m, dtype=torch.uint8)
        return self._boxes[rank]

    @staticmethod
    def fence() -> None:
        dist.barrier()

    def close(self) -> None:
        """Unmap and close every outbox (the files were unlinked at construction). Raises
        BufferError if a view of an outbox is still alive somewhere."""
        self._boxes = {}
        for m in self._maps.values():
            m.close()
        for fd in self._fds.values():
            os.close(fd)
        self._maps, self._fds = {}, {}


_CACHED: Optional[SharedOutboxes] = None


def shared_outboxes(capacity: int) -> SharedOutboxes:
    """The process's outboxes, grown (collectively) to at least ``capacity`` bytes, rounded up
    to a power of two (so a growing need regrows them a few times, not at every switch).

    Kept between switches: creating and mapping them costs about as much as the copies they
    serve (tmpfs zeroes every page; readers map their peers'). They hold their capacity in
    shared memory per rank until ``release_shared_outboxes()``. Every rank must ask for the
    same capacity (the switcher derives it from the plan, which every rank computes alike)."""
    global _CACHED
    if _CACHED is None or _CACHED.capacity < capacity:
        release_shared_outboxes()
        _CACHED = SharedOutboxes(1 << max(0, int(capacity) - 1).bit_length())
    return _CACHED


def release_shared_outboxes() -> None:
    """Unmap the kept outboxes (local; no collective)."""
    global _CACHED
    if _CACHED is not None:
        _CACHED.close()
        _CACHED = None


def outbox_path(token: str, rank: int) -> str:
    """The shared file of ``rank``'s outbox in the setup that rank 0 named ``token``."""
    return os.path.join(SHM_DIR, f"earl-outbox-{token}-{rank}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _create(path: str, capacity: int) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, capacity)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)
