"""Finished episodes from split placement's rollout pool to its train pool, point to point.

Every rank of the world calls ``transfer_episodes`` at the pools' meeting (plan/split.py:
train pool = ranks ``0 .. n_t - 1``, rollout pool = the rest): the rollout pool's ranks pass their
replica's block of the batch (every rank of a replica holds the same episodes), the train pool's
ranks pass nothing (``pack_block`` packs a block, ``transfer_episodes`` moves it). One dispatch
on the world (runtime/dispatcher.py, ``Scope.world()``) moves each episode as one uint8 sample,
its packed bytes (``pack_episode``):

    prefix    tokens n, header bytes h (two little-endian int64)
    per token token_ids int64, loss_mask uint8, logprobs float64, versions int64 (native order)
    header    the rest of the Episode, pickled (h bytes)

One metadata exchange (none where the caller gathered the sizes: ``sizes=``), one shard map, one
round of sends: the meeting is on the rollout's critical path. The earlier two dispatches (the
per-token tensors, then pickled headers, each with its own exchange) took 34 ms for 16 episodes
of 300 tokens on 3 CPU ranks; this one takes 10.5 ms, and 3 ms at split placement's meeting,
whose agreement carries the sizes.

The producer placement is the rollout layout's (a replica holds its episodes whole), shifted
onto the rollout pool's ranks; the consumer gives train replica d the ids of block d
(``train_blocks``: the sorted ids in whole groups, split over the train layout's dp replicas as
evenly as possible, the first replicas taking the extra groups) on every one of its ranks. A
packed episode must arrive whole, so the train layout's cp must be 1 (split placement's is).

Invariants (tests/distributed/test_episode_transfer.py): every rank of train replica d ends with
exactly block d's episodes, equal to what the rollout pool held (logprobs bit-exact: Python
floats are doubles); a rollout rank receives nothing; every byte goes from one rank to one rank,
nothing through a root, nothing to a rank that does not need it.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from array import array
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import TensorSpec, placement_from_assignment, producer_placement
from earl_megatron.plan.shard_map import build_shard_map
from earl_megatron.plan.staleness import replica_quotas
from earl_megatron.runtime.dispatcher import SampleMeta, Scope, exchange_metadata, \
    execute_shard_map

EPISODE = (TensorSpec("episode", "uint8", pp_stages="all"),)
"""The one spec moved: each sample is an episode's packed bytes (its length: their count)."""
_PREFIX = struct.Struct("<qq")


def pack_episode(e: Any) -> bytes:
    """An Episode's bytes (module docstring); ``ValueError`` when its per-token fields differ in
    length (split placement hands over per-token versions: max_staleness >= 1)."""
    n = len(e.token_ids)
    if not len(e.loss_mask) == len(e.logprobs) == len(e.versions) == n:
        raise ValueError(f"episode of {n} tokens has {len(e.loss_mask)} mask, "
                         f"{len(e.logprobs)} logprob and {len(e.versions)} version entries; "
                         "split placement hands over per-token versions (max_staleness >= 1)")
    header = pickle.dumps(dataclasses.replace(e, token_ids=(), loss_mask=(), logprobs=(),
                                              versions=()))
    return b"".join((_PREFIX.pack(n, len(header)), array("q", e.token_ids).tobytes(),
                     bytes(e.loss_mask), array("d", e.logprobs).tobytes(),
                     array("q", e.versions).tobytes(), header))


def unpack_episode(buf) -> Any:
    """The Episode ``pack_episode`` packed (``buf``: its bytes, any buffer)."""
    view = memoryview(buf).cast("B")
    n, h = _PREFIX.unpack_from(view, 0)
    at = _PREFIX.size

    def take(code: str):
        nonlocal at
        a = array(code)
        a.frombytes(view[at:at + n * a.itemsize])
        at += n * a.itemsize
        return tuple(a)

    token_ids, mask = take("q"), tuple(view[at:at + n])
    at += n
    logprobs, versions = take("d"), take("q")
    if at + h != len(view):
        raise ValueError(f"a packed episode of {len(view)} bytes does not hold {n} tokens and a "
                         f"{h}-byte header")
    head = pickle.loads(view[at:])
    return dataclasses.replace(head, token_ids=token_ids, loss_mask=mask, logprobs=logprobs,
                               versions=versions)


def train_blocks(ids: Sequence[int], dp: int, group_size: int = 1) -> list[list[int]]:
    """The batch's sorted sample ids in whole groups of ``group_size``, split over ``dp`` train
    replicas as evenly as possible (``staleness.replica_quotas``)."""
    ids = sorted(ids)
    if len(ids) % group_size:
        raise ValueError(f"{len(ids)} episodes are not whole groups of {group_size}")
    out, start = [], 0
    for q in replica_quotas(len(ids) // group_size, dp):
        out.append(ids[start:start + q * group_size])
        start += q * group_size
    return out


def pack_block(ids: Sequence[int], episodes: Sequence[Any]) -> dict[int, bytes]:
    """This rank's block, packed (``pack_episode``) by sample id; ``ValueError`` naming the
    episode that cannot be."""
    if len(ids) != len(episodes):
        raise ValueError(f"{len(ids)} ids for {len(episodes)} episodes")
    packed = {}
    for s, e in zip(ids, episodes):
        try:
            packed[s] = pack_episode(e)
        except ValueError as err:
            raise ValueError(f"episode {s}: {err}") from None
    return packed


def block_sizes(packed: Mapping[int, bytes]) -> list[tuple[int, int]]:
    """(sample id, bytes) of a packed block, by id: what ``transfer_episodes(sizes=)`` takes
    for each rank."""
    return [(s, len(b)) for s, b in sorted(packed.items())]


def transfer_episodes(train: ParallelLayout, rollout: ParallelLayout,
                      packed: Mapping[int, bytes], *, group_size: int = 1,
                      sizes: Optional[Sequence[Sequence[tuple[int, int]]]] = None
                      ) -> tuple[list[int], list[Any]]:
    """(ids, episodes) of this rank's train replica's block, in id order, on the train pool;
    ([], []) on the rollout pool. Collective over the world (module docstring). ``packed``:
    this rank's block (``pack_block``; empty on the train pool). ``sizes``: every rank's
    ``block_sizes``, in rank order, where the caller already gathered them (split placement's
    meeting carries them in its agreement); None: one metadata exchange here. The episodes are
    rollout/agent_loop.Episode values (not imported: runtime sits below rollout)."""
    world, n_t = dist.get_world_size(), train.world_size
    if train.cp != 1:
        raise ValueError(f"episodes go to a train layout with cp=1 (a packed episode arrives "
                         f"whole); got {train}")
    if sizes is None:
        meta = exchange_metadata([SampleMeta(s, n) for s, n in block_sizes(packed)],
                                 Scope.world())
        sizes = [[(m.sample_id, m.length) for m in part] for part in meta]
    if len(sizes) != world:
        raise ValueError(f"sizes for {len(sizes)} ranks in a world of {world}")
    if any(sizes[r] for r in range(n_t)):
        raise ValueError("train-pool ranks hold no episodes to hand over; pass none there")
    lengths = {s: n for part in sizes for s, n in part}
    producer = producer_placement(rollout, [list(p) for p in sizes[n_t:]],
                                  EPISODE).shifted(n_t, world)
    blocks = train_blocks(sorted(lengths), train.dp, group_size)
    consumer = placement_from_assignment(train, [[b] for b in blocks], lengths,
                                         EPISODE).shifted(0, world)
    local = {"episode": {s: torch.frombuffer(bytearray(b), dtype=torch.uint8)
                         for s, b in packed.items()}}
    got = execute_shard_map(build_shard_map(producer, consumer), producer, consumer, local,
                            scope=Scope.world()).tensors["episode"]
    if dist.get_rank() >= n_t:
        return [], []
    mine = sorted(got)
    return mine, [unpack_episode(got[s].numpy()) for s in mine]
