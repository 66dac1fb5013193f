"""Split placement's runtime base on 4 gloo ranks: two pools, each with its own Megatron-Core
groups, computing at the same time, and the weight handoff between them (runtime/groups.py
``build_pool_groups``, runtime/weight_transfer.py ``hand_off``).

Pools (every rank passes the same): train = ranks 0-1, rollout = ranks 2-3, in two pairings,
DP2 -> TP2 and TP2 -> DP2. Per iteration the train pool takes two optimizer steps (Megatron DDP,
Adam, its schedule) while the rollout pool scores a batch (a forward with its schedule): the
pools run different numbers of collectives, so a collective that reached the other pool would
hang the test. Then the handoff, and both pools gather their full weights (``gather_full``, per
pool). Checked:
- each rank's pool, pool rank and coordinates; Megatron's groups hold global ranks of the pool
  only (tp and dp source ranks, the rank lists);
- after every handoff the rollout pool's weights equal the train pool's, bit-exact, and they
  changed since the last handoff (the steps moved them); the rollout pool received exactly the
  weight plan's bytes and the train pool nothing;
- each pool is cached on its own (the second iteration rebuilds nothing), and a train pool
  switching its layout leaves the rollout pool's groups, and its model, working;
- pools that do not add up to the world are refused, naming both.

Offset pools in pp and ep layouts (``_offset_pools``): PP2 beside TP2 (tiny llama) and EP2
beside DP2 (tiny qwen3_moe, 4 experts, top 2), each pairing in both orders, so the PP2 and EP2
pools run once at ranks 0-1 and once at ranks 2-3, on the same weights and batch: their
logprobs, a train step's loss and the logprobs after that step are equal at either offset, and
equal (to rounding) to the other layout's.
"""

import pytest

from earl_megatron.testing.multiproc import run_distributed

PAIRINGS = [("dp2", "tp2"), ("tp2", "dp2")]


def _two_pools():
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.weight_plan import ShardsIn
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import (forward_logprobs, local_microbatches, random_batch,
                                            train_step)
    from earl_megatron.runtime.transport import Traffic
    from earl_megatron.runtime.weight_transfer import cached_plan, hand_off
    from earl_megatron.weights.gather import gather_full

    torch.set_num_threads(1)
    me = dist.get_rank()
    cfg = ModelConfig.tiny(vocab_size=32)
    out = {"pairings": []}
    with cpu_backend():
        for a, b in PAIRINGS:
            pools = (ParallelLayout.parse(a, 2, cfg), ParallelLayout.parse(b, 2, cfg))
            train_side = me < 2
            lay = pools[0] if train_side else pools[1]
            model = build_on_layout(cfg, lay, pools=pools, seed=11 if train_side else 12,
                                    optimizer=OptimizerSpec(lr=1e-2) if train_side else None)
            pool = groups.current_pool()
            found = {"pool": (pool.index, pool.offset, groups.pool_rank(), str(model.coords)),
                     "tp_src": ps.get_tensor_model_parallel_src_rank(),
                     "dp_src": ps.get_data_parallel_src_rank(),
                     "tp_ranks": list(ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS),
                     "dp_ranks": list(ps._DATA_PARALLEL_GLOBAL_RANKS),
                     "iterations": []}
            for it in range(2):
                if train_side:
                    for step in range(2):
                        batch = random_batch(4, 16, 32, seed=10 * it + step)
                        train_step(model, local_microbatches(batch, lay, model.coords, 1),
                                   seq_len=16, micro_batch_size=1)
                else:
                    batch = random_batch(2, 16, 32, seed=it)
                    forward_logprobs(model, local_microbatches(batch, lay, model.coords, 1),
                                     seq_len=16, micro_batch_size=1)
                traffic = Traffic()
                hand_off(model, pools[0], pools[1], bucket_bytes=40_000, traffic=traffic)
                full = gather_full(model.model, cfg, lay)
                every: list = [None] * 4
                dist.all_gather_object(every, full)
                plan = cached_plan(cfg, pools[0], (ShardsIn(pools[1], (2, 3)),), 40_000, 4)
                found["iterations"].append({
                    "equal": all(torch.equal(every[0][k], every[2][k]) for k in every[0])
                    and set(every[0]) == set(every[2]),
                    "train_pools_agree": all(torch.equal(every[0][k], every[1][k])
                                             for k in every[0]),
                    "bytes": (traffic.bytes_received, plan.recv_bytes()[me]),
                    "weights": {k: v.clone() for k, v in full.items()} if me == 2 else None,
                    "cached": groups.cached_layouts() == [(0, pools[0]), (2, pools[1])],
                })
                # the next iteration finds the pools' groups cached: no group is created
                groups.build_pool_groups(pools, cfg)
            # the train pool moves to another layout; the rollout pool's groups and model stay
            other = ParallelLayout.parse("tp2" if a == "dp2" else "dp2", 2, cfg)
            moved = (other, pools[1])
            if train_side:
                m2 = build_on_layout(cfg, other, pools=moved, seed=13,
                                     optimizer=OptimizerSpec(lr=1e-2))
                r = train_step(m2, local_microbatches(random_batch(4, 16, 32, seed=99), other,
                                                      m2.coords, 1),
                               seq_len=16, micro_batch_size=1)
                works = r.update_successful
            else:
                groups.build_pool_groups(moved, cfg)
                lp = forward_logprobs(model, local_microbatches(random_batch(2, 16, 32, seed=5),
                                                                lay, model.coords, 1),
                                      seq_len=16, micro_batch_size=1)
                works = bool(torch.isfinite(lp[0]).all())
            found["moved"] = (works, groups.cached_layouts() == [(0, pools[0]), (0, other),
                                                                   (2, pools[1])])
            out["pairings"].append(found)
            groups.destroy_groups()
        try:
            groups.build_pool_groups((ParallelLayout(dp=2), ParallelLayout(tp=4)), cfg)
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)
    return out


OFFSET_CASES = [("llama", "pp2", "tp2"), ("qwen3_moe", "ep2", "dp2")]


def _offset_pools():
    import torch
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import (forward_logprobs, local_microbatches, random_batch,
                                            train_step)

    torch.set_num_threads(1)
    me = dist.get_rank()
    out = []
    with cpu_backend():
        for family, a, b in OFFSET_CASES:
            cfg = ModelConfig.tiny(family, vocab_size=32)
            weights = reference_weights(cfg)
            batch = random_batch(2, 16, 32, seed=7)
            for pair in ((a, b), (b, a)):
                pools = tuple(ParallelLayout.parse(x, 2, cfg) for x in pair)
                lay = pools[0] if me < 2 else pools[1]
                m = build_on_layout(cfg, lay, pools=pools, weights=weights,
                                    optimizer=OptimizerSpec(lr=1e-2))
                mbs = local_microbatches(batch, lay, m.coords, 1)
                before = forward_logprobs(m, mbs, seq_len=16, micro_batch_size=1)
                r = train_step(m, mbs, seq_len=16, micro_batch_size=1)
                after = forward_logprobs(m, mbs, seq_len=16, micro_batch_size=1)
                c = m.coords
                # one rank of each dp replica of the last stage holds its samples' logprobs
                holds = c.pp == lay.pp - 1 and c.tp == 0 and c.cp == 0
                out.append(dict(case=family, layout=pair[0] if me < 2 else pair[1], offset=groups.current_pool().offset,
                                dp=c.dp, loss=r.loss, ok=r.update_successful,
                                before=torch.cat(before) if holds else None,
                                after=torch.cat(after) if holds else None))
                del m
                groups.destroy_groups()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return every if me == 0 else None


@pytest.fixture(scope="module")
def offset_results():
    return run_distributed(_offset_pools, 4, timeout=600)[0]


def _pool_values(records, case, layout, offset):
    """A pool's loss and its full batch's logprobs (before, after the step), from its ranks."""
    import torch

    mine = [r for r in records if r["case"] == case and r["layout"] == layout
            and r["offset"] == offset]
    assert len(mine) == 2 and all(r["ok"] for r in mine), mine
    assert len({r["loss"] for r in mine}) == 1, mine     # every rank reports the global loss
    held = sorted((r for r in mine if r["before"] is not None), key=lambda r: r["dp"])
    return (mine[0]["loss"], torch.cat([r["before"] for r in held]),
            torch.cat([r["after"] for r in held]))


@pytest.mark.parametrize("case", OFFSET_CASES, ids=lambda c: f"{c[1]}-beside-{c[2]}")
def test_offset_pools_in_pp_and_ep_compute_what_the_same_pool_at_rank_zero_does(
        offset_results, case):
    import torch

    records = [r for per_rank in offset_results for r in per_rank]
    family, a, b = case
    lay_a, lay_b = a, b
    for lay in (lay_a, lay_b):
        at0, at2 = _pool_values(records, family, lay, 0), _pool_values(records, family, lay, 2)
        assert at0[0] == at2[0], (lay, at0[0], at2[0])        # the offset changes nothing
        assert torch.equal(at0[1], at2[1]) and torch.equal(at0[2], at2[2]), lay
    pa, pb = _pool_values(records, family, lay_a, 2), _pool_values(records, family, lay_b, 2)
    assert abs(pa[0] - pb[0]) <= 1e-5 * abs(pb[0]), (pa[0], pb[0])
    assert pa[1].shape == (2, 16) and torch.allclose(pa[1], pb[1], atol=1e-5), (pa[1] - pb[1])
    assert torch.allclose(pa[2], pb[2], atol=1e-4), (pa[2] - pb[2]).abs().max()
    assert not torch.allclose(pa[1], pa[2], atol=1e-4)          # the step moved the weights


@pytest.fixture(scope="module")
def results():
    return run_distributed(_two_pools, 4, timeout=400)


def test_each_rank_runs_its_pools_layout_on_its_pools_groups(results):
    for k, (a, b) in enumerate(PAIRINGS):
        for rank, res in enumerate(results):
            f = res["pairings"][k]
            index, offset, prank, coords = f["pool"]
            lay = a if rank < 2 else b
            assert (index, offset, prank) == ((0, 0, rank) if rank < 2 else (1, 2, rank - 2))
            pool = [0, 1] if rank < 2 else [2, 3]
            if lay == "tp2":
                assert f["tp_ranks"] == pool and f["dp_ranks"] == [rank], f
                assert f["tp_src"] == pool[0] and "tp=%d" % (rank % 2) in coords
            else:
                assert f["dp_ranks"] == pool and f["tp_ranks"] == [rank], f
                assert f["dp_src"] == pool[0] and "dp=%d" % (rank % 2) in coords


def test_after_every_handoff_the_rollout_pool_holds_the_train_pools_weights(results):
    for k, pairing in enumerate(PAIRINGS):
        its = [res["pairings"][k]["iterations"] for res in results]
        for it in range(2):
            for rank in range(4):
                got = its[rank][it]
                assert got["equal"] and got["train_pools_agree"], (pairing, it, rank)
                received, planned = got["bytes"]
                assert received == planned, (pairing, it, rank, got["bytes"])
                assert (received > 0) == (rank >= 2), (pairing, it, rank, received)
                assert got["cached"], (pairing, it, rank)   # one entry: the pools
        # two train steps between handoffs moved the weights
        w0, w1 = its[2][0]["weights"], its[2][1]["weights"]
        assert any(not (w0[n] == w1[n]).all() for n in w0), pairing


def test_a_pool_changes_layout_without_touching_the_other(results):
    for k, pairing in enumerate(PAIRINGS):
        for rank, res in enumerate(results):
            works, cached = res["pairings"][k]["moved"]
            assert works and cached, (pairing, rank, works, cached)


def test_pools_that_do_not_make_the_world_are_refused(results):
    for res in results:
        assert "hold 6 ranks; the world has 4" in res["refused"], res["refused"]
