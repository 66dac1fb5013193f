"""Split placement's weight handoff (meeting step 4).

The handoff runs on a process group of its own (the world's ranks, made once at setup) whose
timeout is ``cluster.weight_sync_timeout_s``: once every rank has arrived (a world barrier, so
the train pool's start evaluation or a checkpoint write is not counted), a rank that stalls or
dies in the handoff fails it on every other rank within that bound, with ``HandoffFailed``
naming the step, the limit and the checkpoint a rerun resumes from (the newest; the training
since it is done again: the handoff cannot checkpoint, its world is broken). Fault point
``split.handoff`` (info ``it``, ``rank``), tests/distributed/test_split_faults.py.

With SGLang the rollout pool holds no model: full buckets are assembled at the servers'
leaders from the train pool's shards (``hand_off_full``) and kept there; the leaders push them
into their servers after the meeting, outside the handoff's bound. With LoRA adapters
(``model.lora``) the embedded rollout pool gets the whole model at the first handoff between two
pools and the adapters alone at every later one: the base is frozen. SGLang servers likewise:
the whole model whenever they hold no base (just started), else the adapters, which the leaders
load as the version's adapter (trainer/sglang_servers.py).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from earl_megatron.runtime import groups
from earl_megatron.runtime.fault_points import fault_point
from earl_megatron.runtime.switcher import plan_params
from earl_megatron.runtime.transport import Traffic
from earl_megatron.runtime.weight_transfer import WeightPlanError, hand_off, hand_off_full
from earl_megatron.trainer.sglang_servers import replica_leaders

class HandoffFailed(RuntimeError):
    """Split placement's weight handoff timed out or failed on this rank (module docstring)."""


class Handoff:
    """The handoff's own group (every rank, in order: group rank = global rank), so that
    ``cluster.weight_sync_timeout_s`` bounds it, not the world's collective timeout."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        dist.barrier()   # every rank arrives together: the group's setup has that timeout too
        self.group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s))

    def run(self, split, j: int, first: bool = False) -> tuple[float, int]:
        """Weights v_j from ``split``'s train pool to its rollout pool (world); (seconds, bytes
        the busiest rank received). ``first``: these pools' first handoff (a LoRA model's
        frozen base moves then, its adapters every time). Every rank arrives first (a world
        barrier), then the handoff runs on its own group: ``HandoffFailed`` when it times out
        or fails here."""
        t, r = split.pools
        rollout, train_side = split.tr.rollout, split.train_side
        traffic = Traffic()
        if split.sglang and not train_side:
            rollout.ensure_servers(r)   # started (the first handoff) before the barrier
        lora = split.tr.cfg.model.lora.enabled
        if split.sglang and lora:
            # servers that hold no base (just started: the first handoff, a move, a layout
            # restart) take the whole model: the rollout pool knows, the train pool learns it
            fresh = torch.tensor([0 if train_side else int(rollout.servers.fresh)])
            dist.all_reduce(fresh, op=dist.ReduceOp.MAX)
            first = bool(fresh.item())
        dist.barrier()   # the handoff's timeout counts the handoff, not a peer's way to it
        t0 = time.perf_counter()
        try:
            fault_point("split.handoff", it=j, rank=self.rank)
            if split.sglang:
                # full buckets at the servers' leaders, kept there: the servers get them after
                # the meeting (``push_received``), so the handoff's bound never counts a
                # server, and a server's restart is the rollout pool's alone
                buckets = hand_off_full(
                    split.tr.cfg.model, t, replica_leaders(r, range(t.world_size, self.world)),
                    plan_params(split.model)[1] if train_side else None,
                    bucket_bytes=int(split.tr.cfg.rollout.sglang_bucket_mb * 2**20),
                    traffic=traffic, group=self.group,
                    device=None if train_side else groups.device(),
                    adapters_only=lora and not first)
                if train_side:
                    for _ in buckets:
                        pass
                else:
                    rollout.receive(buckets, traffic)
            else:
                # LoRA: the base is frozen, so after these pools' first handoff (the rollout
                # model is built uninitialised: split_sides.build_sides) only the adapters move
                hand_off(split.model, t, r, traffic=traffic, group=self.group,
                         adapters_only=lora and not first)
            got = torch.tensor([traffic.bytes_received], dtype=torch.int64)
            try:
                dist.all_reduce(got, op=dist.ReduceOp.MAX, group=self.group)
            except RuntimeError as e:
                raise WeightPlanError(self.rank, "agreeing the bytes received", e) from e
        except WeightPlanError as e:
            raise HandoffFailed(handoff_failure(
                j, e, time.perf_counter() - t0, n_t=t.world_size, world=self.world,
                saved=split.tr.saved, limit=self.timeout_s, out=split.tr.out)) from e
        seconds = time.perf_counter() - t0
        if split.sglang and not train_side:
            rollout.push_received()     # into the servers: the rollout pool's own time
        split.audit.weights(split, j)
        return seconds, int(got.item())


def handoff_failure(j: int, e: Exception, seconds: float, *, n_t: int, world: int, saved: int,
                    limit: float, out: Path) -> str:
    """What ``HandoffFailed`` says: the handoff, the step and the limit, the checkpoint a rerun
    resumes from and what it does again, and the fix."""
    timed_out = seconds >= 0.9 * limit or "timed out" in str(e).lower()
    what = (f"did not complete within cluster.weight_sync_timeout_s={limit:g} s"
            if timed_out else
            f"failed after {seconds:.1f} s (cluster.weight_sync_timeout_s={limit:g} s)")
    weights = "the start's weights" if j == 0 else f"the weights after iteration {j - 1}"

    def its(first: int, last: int) -> str:
        return f"iteration {first}" if first == last else f"iterations {first}-{last}"

    if saved >= 0:
        again = (f"; it trains {its(saved + 1, j - 1)} again" if saved < j - 1
                 else "; nothing trained is lost")
        resume = (f"the last checkpoint is iteration {saved} "
                  f"({out / 'checkpoints' / f'iter_{saved:06d}'}): a rerun "
                  f"(run.resume=true) resumes there{again}")
    else:
        resume = ("no checkpoint was written yet: a rerun starts from iteration 0"
                  + (f" and trains {its(0, j - 1)} again" if j > 0 else ""))
    return (f"split placement: the weight handoff at meeting {j} ({weights}, train pool "
            f"{ranks_text(0, n_t)} -> rollout pool {ranks_text(n_t, world)}) {what}: "
            f"{e}. {resume[0].upper()}{resume[1:]}. Look for a stalled or dead rank (its "
            "log, the other ranks' errors), or raise cluster.weight_sync_timeout_s if the "
            "handoff is only slow (its usual seconds: split.handoff_s in metrics.jsonl)")


def ranks_text(first: int, end: int) -> str:
    return f"rank {first}" if end - first == 1 else f"ranks {first}-{end - 1}"
