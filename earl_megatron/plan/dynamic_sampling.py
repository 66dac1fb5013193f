"""DAPO's dynamic sampling (algorithm.dynamic_sampling): which finished groups drop, how many
groups a replica plays next, where their keys and seeds come from, and the counts the record
shows. Pure functions; trainer/dynamic_pool.py moves the episodes.

A group (the group_size episodes of one environment seed) whose rewards are all equal has no
signal under a group baseline (every advantage is 0): when it has finished it is dropped, never
trained, and counted. Each rollout replica fills its own block of the batch (its ``quota`` of
groups, plan/staleness.py ``replica_quotas``):

- **A round** plays the replica's live episodes until ``quota`` finished groups with signal are
  held (and no live group is at the staleness bound), or until none is live.
- **Refill** (``refill``): a round that ended with fewer than ``quota`` groups with signal and no
  episode live drops its finished groups without signal and admits new groups into the freed
  slots: up to the replica's target, (k - lag + 1) x quota groups held (k = 0: exactly the
  dropped ones). At most ``max_rounds`` (algorithm.dynamic_sampling_rounds) such extra rounds
  per stage; then the replica's block trains with the groups it has (fewer episodes; none).
  At k >= 1 a dropped group also frees its slot for the next stage's admission (the pool holds
  fewer episodes), so the (k + 1) x batch bound is kept both ways.
- **Keys and seeds** (``extra_group_index``): round r >= 1 of replica d numbers its groups from
  ``span * (1 + (r - 1) * replicas + d)``, ``span`` being the most groups one admission can
  start, so no two replicas or rounds of one iteration share a key or an environment seed
  without a collective; the index must stay under seeds.ITERATION_STRIDE (checked).

Invariants (tests/unit/test_dynamic_sampling.py): a group with equal rewards never trains; a
replica never holds more than its target after a refill; ``refill`` is 0 once ``max_rounds``
rounds were played or the quota is met; the counts add up: played = trained + dropped + carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def has_signal(rewards: Sequence[float]) -> bool:
    """Does a finished group's reward vary (a group baseline gives it nonzero advantages)?"""
    return len(rewards) > 1 and max(rewards) != min(rewards)


def refill(quota: int, signal: int, held: int, target: int, rounds_played: int,
           max_rounds: int) -> int:
    """New groups for the replica's next round, after a round that left no episode live:
    ``signal`` finished groups with signal held (of ``held`` groups, the dropped ones gone),
    ``target`` groups at most. 0 when the quota is met or ``max_rounds`` extra rounds were
    played."""
    if min(quota, signal, held, target, rounds_played, max_rounds) < 0:
        raise ValueError(f"negative count: quota={quota} signal={signal} held={held} "
                         f"target={target} rounds_played={rounds_played} max_rounds={max_rounds}")
    if signal >= quota or rounds_played >= max_rounds:
        return 0
    return max(0, target - held)


def extra_group_index(rnd: int, replica: int, replicas: int, span: int, j: int,
                      stride: int) -> int:
    """The group index (in its iteration) of group ``j`` of extra round ``rnd`` (>= 1) on
    ``replica`` of ``replicas``; ``span``: the most groups one admission starts (round 0's
    indices are below it). Raises when it would reach ``stride`` (the seeds of the next
    iteration)."""
    if rnd < 1 or not 0 <= replica < replicas or not 0 <= j < span:
        raise ValueError(f"round {rnd}, replica {replica} of {replicas}, group {j} of {span}")
    index = span * (1 + (rnd - 1) * replicas + replica) + j
    if index >= stride:
        raise ValueError(f"dynamic sampling's extra round {rnd} on replica {replica} would start "
                         f"group {index} of its iteration, past the {stride} groups an "
                         "iteration's seeds hold: lower algorithm.dynamic_sampling_rounds or "
                         "rollout.episodes_per_iteration")
    return index


@dataclass(frozen=True)
class DynamicCounts:
    """One stage's groups under dynamic sampling, summed over the replicas (the record's
    ``dynamic_*`` keys). ``played``: groups the stage played (carried in, admitted, and admitted
    in extra rounds); each ends the stage trained, dropped (finished with equal rewards) or
    carried (live, or finished and waiting: k >= 1)."""

    played: int = 0
    dropped: int = 0
    trained: int = 0
    carried: int = 0
    rounds: int = 0
    """Extra rounds played (the most over the replicas)."""

    def __post_init__(self):
        if self.played != self.trained + self.dropped + self.carried:
            raise ValueError(f"dynamic sampling's counts do not add up: played {self.played} != "
                             f"trained {self.trained} + dropped {self.dropped} + carried "
                             f"{self.carried}")

    def as_list(self) -> list[int]:
        return [self.played, self.dropped, self.trained, self.carried, self.rounds]

    @classmethod
    def summed(cls, parts: Sequence[Sequence[int]]) -> "DynamicCounts":
        """The world's counts from each replica's ``as_list`` (rounds: the most)."""
        tot = [sum(p[i] for p in parts) for i in range(4)]
        return cls(*tot, rounds=max((p[4] for p in parts), default=0))

    def metrics(self) -> dict:
        return {"dynamic_groups_played": self.played, "dynamic_groups_dropped": self.dropped,
                "dynamic_groups_trained": self.trained, "dynamic_groups_carried": self.carried,
                "dynamic_rounds": self.rounds}
