"""Dynamic sampling's side of the episode pool (trainer/episode_pool.py; the rule is
plan/dynamic_sampling.py's): the finished groups without signal dropped from a replica's
entries, and the stage's counts summed over the world for the record.

A dropped group's episodes leave the pool at once: they are never picked, never carried into a
checkpoint, never trained; its slot is free for the replica's next round or the next stage's
admission.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from earl_megatron.plan.dynamic_sampling import DynamicCounts, has_signal
from earl_megatron.runtime import groups


def group_rewards(entries: list, extra: list = ()) -> dict:
    """{group key: each member's reward, None while it is live}; ``extra``: (key, Episode)
    pairs finished but not yet kept (play_turns' ``enough`` sees them first)."""
    ended = dict(extra)
    out: dict = {}
    for e in entries:
        ep = e.episode if e.episode is not None else ended.get(e.key)
        out.setdefault(e.group, []).append(None if ep is None else ep.reward)
    return out


def drop_flat(entries: list) -> tuple[list, int]:
    """(the entries less every finished group whose rewards are all equal, how many groups
    went)."""
    flat = {gk for gk, r in group_rewards(entries).items()
            if None not in r and not has_signal(r)}
    return [e for e in entries if e.group not in flat], len(flat)


def world_counts(pool, out: Optional[Any]) -> dict:
    """The record's ``dynamic_*`` keys for the stage just played, the same on every rank of the
    rollout pool (collective over it; ``out`` None where the stage was abandoned: that rank
    adds nothing). Each replica's leader adds its replica's counts."""
    mine = out.dynamic if out is not None and pool.leader else None
    got: list = [None] * groups.pool_span()[1]
    dist.all_gather_object(got, mine, group=groups.pool_group())
    return DynamicCounts.summed([p for p in got if p is not None]).metrics()
