"""Finished episodes from split placement's rollout pool to its train pool, point to point.

Every rank of the world calls ``transfer_episodes`` at the pools' meeting (plan/split.py:
train pool = ranks ``0 .. n_t - 1``, rollout pool = the rest): the rollout pool's ranks pass their
replica's block of the batch (every rank of a replica holds the same episodes), the train pool's
ranks pass nothing. Two dispatches on the world (runtime/dispatcher.py, ``Scope.world()``):

    tensors   token_ids int64, loss_mask uint8, logprobs float64, versions int64, per token
    headers   the rest of each Episode, pickled, as one uint8 tensor of its byte count

The producer placement is the rollout layout's (a replica holds its episodes whole), shifted
onto the rollout pool's ranks; the consumer gives train replica d the ids of block d
(``train_blocks``: the sorted ids in whole groups, split over the train layout's dp replicas as
evenly as possible, the first replicas taking the extra groups) on every one of its ranks.

Invariants (tests/distributed/test_episode_transfer.py): every rank of train replica d ends with
exactly block d's episodes, equal to what the rollout pool held (logprobs bit-exact: Python
floats are doubles); a rollout rank receives nothing; every byte goes from one rank to one rank,
nothing through a root, nothing to a rank that does not need it.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Sequence

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import TensorSpec, placement_from_assignment, producer_placement
from earl_megatron.plan.shard_map import build_shard_map
from earl_megatron.plan.staleness import replica_quotas
from earl_megatron.runtime.dispatcher import SampleMeta, Scope, exchange_metadata, \
    execute_shard_map

EPISODE_TENSORS = (TensorSpec("token_ids", "int64", pp_stages="all"),
                   TensorSpec("loss_mask", "uint8", pp_stages="all"),
                   TensorSpec("logprobs", "float64", pp_stages="all"),
                   TensorSpec("versions", "int64", pp_stages="all"))
HEADER = (TensorSpec("header", "uint8", pp_stages="all"),)
_DTYPE = {"int64": torch.int64, "uint8": torch.uint8, "float64": torch.float64}


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


def _move(train: ParallelLayout, rollout: ParallelLayout, specs, lengths_mine: dict[int, int],
          local: dict, blocks_of) -> dict:
    """One dispatch rollout pool -> train pool of ``specs`` (every tensor per token of the
    given lengths); returns what this rank received."""
    world, n_t = dist.get_world_size(), train.world_size
    meta = exchange_metadata([SampleMeta(s, n) for s, n in sorted(lengths_mine.items())],
                             Scope.world())
    if any(meta[r] for r in range(n_t)):
        raise ValueError("train-pool ranks hold no episodes to hand over; pass none there")
    lengths = {m.sample_id: m.length for part in meta for m in part}
    reports = [[(m.sample_id, m.length) for m in part] for part in meta[n_t:]]
    producer = producer_placement(rollout, reports, specs).shifted(n_t, world)
    blocks = blocks_of(sorted(lengths))
    consumer = placement_from_assignment(train, [[b] for b in blocks], lengths,
                                         specs).shifted(0, world)
    got = execute_shard_map(build_shard_map(producer, consumer), producer, consumer, local,
                            scope=Scope.world())
    return got.tensors


def transfer_episodes(train: ParallelLayout, rollout: ParallelLayout, ids: Sequence[int],
                      episodes: Sequence[Any], *, group_size: int = 1
                      ) -> tuple[list[int], list[Any]]:
    """(ids, episodes) of this rank's train replica's block, in id order, on the train pool;
    ([], []) on the rollout pool. Collective over the world (module docstring). ``episodes``
    are rollout/agent_loop.Episode values (not imported: runtime sits below rollout)."""
    if len(ids) != len(episodes):
        raise ValueError(f"{len(ids)} ids for {len(episodes)} episodes")
    n_t = train.world_size
    me = dist.get_rank()

    def blocks_of(all_ids):
        return train_blocks(all_ids, train.dp, group_size)

    local: dict = {}
    for s, e in zip(ids, episodes):
        n = len(e.token_ids)
        if not len(e.loss_mask) == len(e.logprobs) == len(e.versions) == n:
            raise ValueError(f"episode {s}: {n} tokens but {len(e.loss_mask)} mask, "
                             f"{len(e.logprobs)} logprob and {len(e.versions)} version entries; "
                             "split placement hands over per-token versions (max_staleness >= 1)")
        for t in EPISODE_TENSORS:
            local.setdefault(t.name, {})[s] = torch.tensor(getattr(e, t.name),
                                                           dtype=_DTYPE[t.dtype])
    tensors = _move(train, rollout, EPISODE_TENSORS,
                    {s: len(e.token_ids) for s, e in zip(ids, episodes)}, local, blocks_of)
    headers = {s: pickle.dumps(dataclasses.replace(e, token_ids=(), loss_mask=(), logprobs=(),
                                                   versions=()))
               for s, e in zip(ids, episodes)}
    got = _move(train, rollout, HEADER, {s: len(b) for s, b in headers.items()},
                {"header": {s: torch.frombuffer(bytearray(b), dtype=torch.uint8)
                            for s, b in headers.items()}}, blocks_of)
    if me >= n_t:
        return [], []
    mine = sorted(got.get("header", {}))
    out = []
    for s in mine:
        head = pickle.loads(got["header"][s].numpy().tobytes())
        out.append(dataclasses.replace(
            head, token_ids=tuple(tensors["token_ids"][s].tolist()),
            loss_mask=tuple(tensors["loss_mask"][s].tolist()),
            logprobs=tuple(tensors["logprobs"][s].tolist()),
            versions=tuple(tensors["versions"][s].tolist())))
    return mine, out
