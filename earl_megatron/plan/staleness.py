"""Asynchronous RL's rules: which episodes may start, which may still train, which replica plays
each, and how stale the trained tokens were. Pure functions of counts and versions.

Versions. The policy's version is the number of train steps behind it: iteration ``it``'s
rollout samples with version ``it`` and its TRAIN step trains version ``it`` into ``it + 1``.
A token sampled by version ``u`` and trained in iteration ``it`` has staleness ``it - u``.

With ``max_staleness`` k (algorithm.max_staleness):

- **Admission** (``admissible``): a rollout stage starts new episodes, in whole groups, until
  (k + 1) batches' worth are in flight or finished-but-untrained. k = 0 admits exactly one batch
  into an empty pool: the synchronous loop. Sampling L versions behind the iteration (split
  placement's rollout pool, L = 1 in steady state) admits (k - L + 1) batches.
- **The bound** (``too_stale``): a group (GRPO's episodes of one seed; a single episode
  otherwise) trains only whole, in the iteration its last episode finishes or later, so it may
  continue into iteration ``it`` only while ``it - oldest <= k`` (``oldest``: the oldest
  version among its sampled tokens). A group past it is dropped, and counted, never trained:
  no trained token is older than k.
- **The stage's end**: a replica's rollout stage ends once ``quota`` of its groups have
  finished (``replica_quotas``: the batch's groups split over the replicas as evenly as
  ``rollout.engine.split_evenly`` splits them) and none of its live groups ``must_finish``
  (one that could not continue into the next stage is waited for, so a long episode is never
  dropped for being long); the oldest finished groups train (``pick_trained``), the rest wait
  and the unfinished continue next stage. A drop then happens only to a pool restored under a
  smaller k.
- **Placement** (``assign_groups``): a group stays on its replica while the rollout layout
  stays the same (its environment lives there); after a layout change the carried groups are
  dealt out again, oldest first, and new groups fill each replica to (k + 1) x its quota.

Invariants (tests/unit/test_staleness.py): the pool never holds more than (k + 1) x batch
episodes after admission; every replica's target is at least its quota, so each stage can end;
``pick_trained`` returns exactly ``quota`` groups when that many have finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class GroupState:
    """One group of the pool as the planner sees it."""

    key: tuple[int, int]
    """(the iteration it started in, its index among that iteration's groups)."""
    size: int
    """Episodes in the group."""
    oldest: Optional[int]
    """The oldest version among its sampled tokens; None before its first turn."""
    finished: bool
    """Every episode of it has ended."""
    replica: Optional[int] = None
    """The rollout replica (dp index) that holds it; None for a group not started yet."""


def too_stale(oldest: Optional[int], iteration: int, max_staleness: int) -> bool:
    """Would a group whose oldest sampled token is version ``oldest`` break the bound if trained
    in ``iteration`` or later?"""
    return oldest is not None and iteration - oldest > max_staleness


def must_finish(oldest: Optional[int], iteration: int, max_staleness: int) -> bool:
    """Must a live group finish in iteration ``iteration``'s stage? It must when it could not
    continue into the next one (``too_stale`` there): the stage plays on until it has, so the
    bound is kept by waiting for the group, not by dropping it."""
    return too_stale(oldest, iteration + 1, max_staleness)


def admissible(max_staleness: int, batch: int, group_size: int, held: int,
               lag: int = 0) -> int:
    """New groups a rollout stage may start when ``held`` episodes are in flight or finished
    and untrained: (k + 1) x ``batch`` episodes at most, in whole groups.

    ``lag``: train steps the sampling weights trail the iteration (split placement: the rollout
    pool samples with the weights of the step before the one that trains its batch). A group
    started at lag L can train only in the k - L + 1 steps that keep its oldest token within k,
    so (k - L + 1) batches at most; k = L admits one batch, and L > k none."""
    if batch % group_size:
        raise ValueError(f"a batch of {batch} episodes is not whole groups of {group_size}")
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    room = (max_staleness - lag + 1) * batch - held
    return max(0, room // group_size)


def replica_quotas(groups: int, replicas: int) -> list[int]:
    """Groups each rollout replica contributes to one batch: ``groups`` split as evenly as
    possible, the first replicas taking the extra ones."""
    base, extra = divmod(groups, replicas)
    return [base + (1 if r < extra else 0) for r in range(replicas)]


def assign_groups(carried: Sequence[GroupState], new: int, quotas: Sequence[int],
                  max_staleness: int, same_layout: bool) -> tuple[dict, list[int]]:
    """(replica of each carried group's key, replica of each new group in order).

    Carried groups stay where they are when ``same_layout`` (their environments live there);
    otherwise they are dealt oldest first to the replica with the most room. New groups then go,
    one at a time, to the replica with the most room left under (k + 1) x quota (ties: the
    lower index), so the replicas' in-flight loads stay in proportion to their quotas."""
    target = [(max_staleness + 1) * q for q in quotas]
    load = [0] * len(quotas)
    where: dict = {}
    movable = []
    for g in carried:
        if same_layout and g.replica is not None and g.replica < len(quotas):
            where[g.key] = g.replica
            load[g.replica] += 1
        else:
            movable.append(g)
    movable.sort(key=lambda g: (g.oldest if g.oldest is not None else 1 << 62, g.key))
    for g in movable:
        r = max(range(len(quotas)), key=lambda i: (target[i] - load[i], -i))
        where[g.key] = r
        load[r] += 1
    placed = []
    for _ in range(new):
        r = max(range(len(quotas)), key=lambda i: (target[i] - load[i], -i))
        placed.append(r)
        load[r] += 1
    return where, placed


def pick_trained(finished: Sequence[GroupState], quota: int) -> list[tuple[int, int]]:
    """The keys of the ``quota`` finished groups to train now: the oldest first (least stale),
    then in start order."""
    order = sorted(finished, key=lambda g: (g.oldest if g.oldest is not None else 1 << 62,
                                            g.key))
    return [g.key for g in order[:quota]]


@dataclass(frozen=True)
class Staleness:
    mean: float
    max: int
    shares: dict
    """{age: fraction of trained tokens of that age}."""
    tokens: int


def staleness(ages: dict, tokens: int) -> Staleness:
    """The record's staleness from {age: trained tokens of that age} (summed over every
    replica). No trained token: all zero."""
    if tokens <= 0:
        return Staleness(0.0, 0, {}, 0)
    mean = sum(a * n for a, n in ages.items()) / tokens
    return Staleness(mean, max((a for a, n in ages.items() if n), default=0),
                     {a: n / tokens for a, n in sorted(ages.items()) if n}, tokens)


def token_ages(versions: Sequence[int], loss_mask: Sequence[int], iteration: int) -> dict:
    """{age: count} over one episode's trained tokens (loss mask 1); an episode without
    versions (an agent program's rows) was sampled by the version it trains."""
    ages: dict = {}
    if not versions:
        n = sum(1 for m in loss_mask if m)
        return {0: n} if n else {}
    for v, m in zip(versions, loss_mask):
        if m:
            a = iteration - v
            ages[a] = ages.get(a, 0) + 1
    return ages
