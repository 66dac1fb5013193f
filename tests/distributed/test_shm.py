"""Shared outboxes between gloo ranks of one host (runtime/shm.py, runtime/transport.py), 2 ranks.

One launch: bytes written into an outbox are read by the peer after a fence; outboxes grow to
powers of two and are reused; a capacity the tmpfs cannot hold fails on every rank alike
(SharedOutboxError), after which "auto" falls back to isend/irecv and "shm" raises; and no
file of this job is ever left in /dev/shm: not after a normal setup, and not when a peer raises
or is killed in the middle of setup (the survivor removes its own file and the dead peer's).
"""

import json
import os
import time

import pytest

from earl_megatron.testing.multiproc import run_distributed

pytestmark = pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")


def _leftovers(pid0, ranks):
    """This job's files in /dev/shm: the outboxes of ``ranks`` (named by rank 0's pid and the
    rank) and this process's probe files."""
    return sorted(f for f in os.listdir("/dev/shm")
                  if (f.startswith(f"earl-outbox-{pid0}-") and f.rsplit("-", 1)[1] in map(str, ranks))
                  or f.startswith(f"earl-probe-{os.getpid()}-"))


def _job():
    import torch
    import torch.distributed as dist

    from earl_megatron.runtime import shm
    from earl_megatron.runtime.transport import Message, Traffic, open_outboxes, run_rounds

    me, peer = dist.get_rank(), 1 - dist.get_rank()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    out = {"same_host": shm.shared_memory_world(), "files": []}
    boxes = shm.shared_outboxes(3000)
    out["capacity"] = boxes.capacity
    out["files"].append(_leftovers(pids[0], [me]))
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
    out["files"].append(_leftovers(pids[0], [me]))
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


def _broken_setup(how, report):
    """Rank 1 breaks SharedOutboxes' setup after creating its file, before the peers' exchange:
    ``raise`` (an exception out of the collective) or ``kill`` (the process dies on the spot).
    Rank 0 reports, after its own setup failed, what is left of the job in /dev/shm."""
    import torch.distributed as dist

    from earl_megatron.runtime import shm

    me = dist.get_rank()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if me == 1:
        def broken(*args, **kwargs):
            assert _job_files(pids)   # this rank's file exists now
            if how == "kill":
                os._exit(3)
            raise RuntimeError("peer failed mid-setup")
        dist.all_gather_object = broken
    try:
        shm.SharedOutboxes(4096)
        error = None
    except Exception as e:  # noqa: BLE001 - the survivor's error is what the collective raised
        error = type(e).__name__
    left = _leftovers(pids[0], [0, 1])
    if me == 0:
        with open(report, "w") as f:
            json.dump({"pids": pids, "error": error, "left": left}, f)
    return {"error": error, "left": left}


def _job_files(pids):
    """Any outbox or probe in /dev/shm named by one of the job's pids."""
    return [f for f in os.listdir("/dev/shm") for p in pids
            if f.startswith((f"earl-outbox-{p}-", f"earl-probe-{p}-"))]


def _wait_report(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def test_a_peer_that_raises_mid_setup_leaves_nothing_in_dev_shm(tmp_path):
    report = tmp_path / "report.json"
    results = run_distributed(_broken_setup, 2, "raise", str(report), timeout=120,
                              collective_timeout_s=30)
    assert results[1] == {"error": "RuntimeError", "left": []}
    assert results[0]["error"] is not None and results[0]["left"] == []
    assert not _job_files(_wait_report(report)["pids"])


def test_a_peer_killed_mid_setup_leaves_nothing_in_dev_shm(tmp_path):
    report = tmp_path / "report.json"
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died with exit codes \[3\]"):
        run_distributed(_broken_setup, 2, "kill", str(report), timeout=120,
                        collective_timeout_s=30)
    got = _wait_report(report)
    # the survivor's collective failed, and it removed its own file and the dead peer's
    assert got["error"] is not None and got["left"] == [], got
    assert not _job_files(got["pids"])
