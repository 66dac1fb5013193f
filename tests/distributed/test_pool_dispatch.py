"""The dispatcher under split placement (runtime/dispatcher.py ``Scope``) on 4 gloo ranks:
train pool = ranks 0-1 (DP2), rollout pool = ranks 2-3 (TP2), runtime/groups.py
``build_pool_groups``.

- Inside each pool, at the same time, a dispatch of the pool's own samples (the train pool
  DP2 -> TP2, the rollout pool TP2 -> DP2, different samples and counts): the default scope is
  the pool, shard-map ranks are pool ranks, and what each consumer rank receives equals the
  truth bit for bit.
- Between the pools (``Scope.world()``, placements ``shifted`` onto the world): episodes' tensors
  from the rollout pool's replica to the train pool's DP2 replicas, each sample to exactly one
  train replica's ranks, nothing to the rollout ranks; bytes equal to what the train side lacks.
"""

import pytest

from earl_megatron.testing.multiproc import run_distributed


def _truth(name: str, s: int, length: int):
    import torch

    if name == "tokens":
        return torch.arange(length, dtype=torch.int64) + 1000 * s
    if name == "logprobs":
        return -(torch.arange(length, dtype=torch.float64) + s) / 7.0
    return torch.tensor([0.5 * s], dtype=torch.float32)


def _local(placement, rank: int):
    import torch

    out = {t.name: {} for t in placement.tensors}   # every name, as the dispatcher returns
    for t in placement.tensors:
        for s in placement.local_samples(rank, t.name):
            full = _truth(t.name, s, placement.length_of[s])
            out[t.name][s] = torch.cat(
                [full[a:b] for a, b in placement.intervals(rank, t.name, s)])
    return out


def _received_ok(consumer, rank: int, got) -> bool:
    import torch

    want = _local(consumer, rank)
    return set(want) == set(got) and all(
        set(want[n]) == set(got[n]) and all(torch.equal(want[n][s], got[n][s]) for s in want[n])
        for n in want)


def _run():
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.placement import (TensorSpec, consumer_placement,
                                              producer_placement)
    from earl_megatron.plan.shard_map import build_shard_map
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.dispatcher import (SampleMeta, Scope, dispatch,
                                                  execute_shard_map)

    specs = (TensorSpec("tokens", "int64"), TensorSpec("logprobs", "float64"),
             TensorSpec("reward", "float32", per_token=False))
    dp2, tp2 = ParallelLayout(dp=2), ParallelLayout(tp=2)
    me = dist.get_rank()
    out = {}
    with cpu_backend():
        groups.build_pool_groups((dp2, tp2))
        prank = groups.pool_rank()
        # 1. inside each pool: the train pool's samples 0-5 (rank 0: 0-2, rank 1: 3-5), DP2 ->
        # TP2; the rollout pool's samples 10-13 (one TP2 replica holds all), TP2 -> DP2
        if me < 2:
            src, dst = dp2, tp2
            lengths = {s: 5 + 3 * s for s in range(6)}
            mine = [s for s in lengths if s // 3 == prank]
        else:
            src, dst = tp2, dp2
            lengths = {s: 20 + s for s in range(10, 14)}
            mine = list(lengths)
        reports = [[(s, lengths[s]) for s in lengths if (src.dp == 1 or s // 3 == r)]
                   for r in range(2)]
        producer = producer_placement(src, reports, specs)
        res, consumer, meta = dispatch(src, dst, [SampleMeta(s, lengths[s]) for s in mine],
                                       _local(producer, prank), specs)
        out["inside"] = (_received_ok(consumer, prank, res.tensors), len(meta),
                         sorted({m.sample_id for part in meta for m in part}))
        # 2. between the pools: the rollout replica's episodes 20-25 -> the train pool's DP2
        lengths = {s: 3 + s % 4 for s in range(20, 26)}
        rollout_reports = [[(s, n) for s, n in lengths.items()] for _ in range(2)]
        producer = producer_placement(tp2, rollout_reports, specs).shifted(2, 4)
        blocks = [[list(range(20, 23))], [list(range(23, 26))]]
        consumer = consumer_placement(dp2, lengths, specs, assignment=blocks).shifted(0, 4)
        smap = build_shard_map(producer, consumer)
        got = execute_shard_map(smap, producer, consumer, _local(producer, me),
                                scope=Scope.world())
        out["across"] = (_received_ok(consumer, me, got.tensors),
                         sorted(got.tensors.get("tokens", {})), got.stats.bytes_received)
        groups.destroy_groups()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 4, timeout=300)


def test_each_pool_dispatches_its_own_samples_at_once(results):
    for rank, res in enumerate(results):
        ok, ranks, samples = res["inside"]
        assert ok and ranks == 2, (rank, res["inside"])
        assert samples == (list(range(6)) if rank < 2 else list(range(10, 14)))


def test_episodes_cross_from_the_rollout_pool_to_the_train_pool_once(results):
    (ok0, ids0, b0), (ok1, ids1, b1) = results[0]["across"], results[1]["across"]
    assert ok0 and ok1 and ids0 == [20, 21, 22] and ids1 == [23, 24, 25]
    # every train rank receives exactly its block's bytes: tokens 8 B, logprobs 8 B a token,
    # a 4 B reward a sample
    for ids, got in ((ids0, b0), (ids1, b1)):
        assert got == sum(16 * (3 + s % 4) + 4 for s in ids), (ids, got)
    for res in results[2:]:
        ok, ids, got = res["across"]
        assert ok and ids == [] and got == 0
