"""Shared outboxes between gloo ranks of one host (runtime/shm.py, runtime/transport.py), 2 ranks.

One launch: bytes written into an outbox are read by the peer after a fence; outboxes grow to
powers of two and are reused; a capacity the tmpfs cannot hold fails on every rank alike
(SharedOutboxError), after which "auto" falls back to isend/irecv and "shm" raises; and no
file of this job is ever left in /dev/shm.
"""

import os

import pytest

from earl_megatron.testing.multiproc import run_distributed

pytestmark = pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")


def _leftovers():
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("earl-")
                  and f.split("-")[2] == str(os.getpid()))


def _job():
    import torch
    import torch.distributed as dist

    from earl_megatron.runtime import shm
    from earl_megatron.runtime.transport import Message, Traffic, open_outboxes, run_rounds

    me, peer = dist.get_rank(), 1 - dist.get_rank()
    out = {"same_host": shm.shared_memory_world(), "files": []}
    boxes = shm.shared_outboxes(3000)
    out["capacity"] = boxes.capacity
    out["files"].append(_leftovers())
    boxes.outbox()[:8] = torch.arange(8, dtype=torch.uint8) + 10 * me
    boxes.fence()
    out["read"] = boxes.inbox(peer)[:8].tolist()
    boxes.fence()
    out["reused"] = shm.shared_outboxes(4096) is boxes
    out["grown"] = shm.shared_outboxes(5000).capacity

    # a round through the transport: a strided view on each side, 600 float32 each way
    src = torch.arange(1200, dtype=torch.float32).view(30, 40) + 10_000 * me
    dst = torch.zeros(40, 30)
    msgs = [[Message(r, 1 - r, 600 * 4, r) for r in (0, 1)]]
    traffic = Traffic()
    run_rounds(msgs, me, lambda m: [src[:, :20]], lambda m: [dst[:, 10:25]],
               open_outboxes("shm", msgs, True), traffic)
    out["strided"] = torch.equal(dst[:, 10:25].reshape(-1),
                                 (torch.arange(1200.).view(30, 40) + 10_000 * peer)[:, :20]
                                 .reshape(-1))
    out["traffic"] = (traffic.transport, traffic.bytes_sent, traffic.bytes_received)

    # a capacity no tmpfs holds: every rank fails alike, and nothing is left behind
    try:
        shm.SharedOutboxes(1 << 50)
        out["huge"] = "created"
    except shm.SharedOutboxError:
        out["huge"] = "refused"
    shm.release_shared_outboxes()
    big = [[Message(0, 1, 1 << 50, None)]]
    out["auto_falls_back"] = open_outboxes("auto", big, True) is None
    try:
        open_outboxes("shm", big, True)
        out["shm_raises"] = False
    except shm.SharedOutboxError:
        out["shm_raises"] = True
    out["p2p"] = open_outboxes("p2p", msgs, True) is None
    out["files"].append(_leftovers())
    return out


def test_shared_outboxes_exchange_grow_refuse_and_leave_nothing():
    results = run_distributed(_job, 2, timeout=120)
    for me, out in enumerate(results):
        assert out["same_host"]
        assert out["capacity"] == 4096 and out["reused"] and out["grown"] == 8192
        assert out["read"] == [10 * (1 - me) + i for i in range(8)]
        assert out["strided"] and out["traffic"] == ("shm", 2400, 2400)
        assert out["huge"] == "refused"
        assert out["auto_falls_back"] and out["shm_raises"] and out["p2p"]
        assert out["files"] == [[], []]   # unlinked as soon as every peer had opened them
