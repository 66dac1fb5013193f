"""The dispatcher on 4 and 8 gloo ranks: every consumer gets bit-identical tensors, reductions
equal the single-process result, the centralized baseline delivers the same data.

Each launch runs several producer/consumer layout pairs (process start dominates). Every rank
regenerates the full batch from the seed, so it can check what it received against the truth.
"""

import random

import pytest

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import consumer_placement, producer_placement
from earl_megatron.plan.shard_map import Topology
from earl_megatron.testing.multiproc import run_distributed
from earl_megatron.testing.varied_tensors import VARIED_TENSORS

pytestmark = pytest.mark.distributed

# (producer, consumer, micro-batches, ranks per node, latency_s, producer pp_stages)
CASES_4 = [
    ("dp4", "tp2-pp2", 1, 0, 1e-5, None),
    ("tp2-dp2", "cp2-dp2", 2, 0, 1e-5, None),
    ("pp2-dp2", "tp4", 1, 0, 1e-5, {"tokens": "all"}),
    ("dp4", "tp2-dp2", 1, 2, 0.0, None),         # 2 nodes, latency 0: fan-out is taken
    ("cp2-dp2", "cp2-pp2", 1, 2, 0.0, None),
]
CASES_8 = [
    ("dp8", "tp2-pp2-dp2", 2, 0, 1e-5, None),
    ("tp2-dp4", "cp2-pp2-dp2", 2, 4, 0.0, None),
    ("tp4-dp2", "tp2-cp2-dp2", 1, 4, 0.0, None),
    ("pp2-dp4", "dp8", 3, 0, 1e-5, {"tokens": "all"}),
    ("cp4-dp2", "tp8", 1, 2, 0.0, None),
]


def lengths_for(seed: int, n: int) -> dict[int, int]:
    rng = random.Random(seed)
    return {s: rng.choice([1, 2, 3, rng.randint(4, 300)]) for s in range(n)}


def full_tensor(name: str, s: int, length: int, seed: int):
    import torch
    spec = {t.name: t for t in VARIED_TENSORS}[name]
    index = [t.name for t in VARIED_TENSORS].index(name)
    g = torch.Generator().manual_seed(seed * 1_000_003 + s * 31 + index)
    n = spec.elements(length)
    if spec.dtype == "int64":
        return torch.randint(0, 50_000, (n,), generator=g)
    if spec.dtype == "bool":
        return torch.rand(n, generator=g) < 0.7
    return torch.randn(n, generator=g)


def _run_cases(cases, seed):
    import torch
    import torch.distributed as dist

    from earl_megatron.runtime.dispatcher import (SampleMeta, dispatch, execute_shard_map,
                                                  owned_slices, plan_dispatch)
    from earl_megatron.testing.baselines import dispatch_centralized
    from earl_megatron.runtime.reduce import global_moments
    rank, world = dist.get_rank(), dist.get_world_size()
    report = []
    for i, (prod, cons, mbs, rpn, lat, pp_stages) in enumerate(cases):
        P = ParallelLayout.parse(prod, world)
        C = ParallelLayout.parse(cons, world)
        case_seed = seed + 97 * i
        lengths = lengths_for(case_seed, 4 * world)
        full = {(t.name, s): full_tensor(t.name, s, n, case_seed)
                for t in VARIED_TENSORS for s, n in lengths.items()}
        my_dp = P.coords(rank).dp
        meta = [SampleMeta(s, n, s // 4) for s, n in lengths.items() if s % P.dp == my_dp]
        topo = Topology(ranks_per_node=rpn, latency_s=lat)
        # what the producer placement says this rank holds, cut from the full tensors
        everyone = [[SampleMeta(s, n, s // 4) for s, n in lengths.items()
                     if s % P.dp == P.coords(r).dp] for r in range(world)]
        producer, consumer, smap = plan_dispatch(P, C, everyone, VARIED_TENSORS,
                                                 num_micro_batches=mbs, topology=topo,
                                                 producer_pp_stages=pp_stages)
        local = {}
        for p in producer.pieces_of(rank):
            local.setdefault(p.tensor, {}).setdefault(p.sample_id, []).append(
                full[p.tensor, p.sample_id][p.start:p.end])
        local = {k: {s: torch.cat(v) for s, v in d.items()} for k, d in local.items()}

        result, consumer2, gathered = dispatch(P, C, meta, local, VARIED_TENSORS,
                                               num_micro_batches=mbs, topology=topo,
                                               producer_pp_stages=pp_stages)
        assert consumer2 == consumer, "plan differs from the one built from the same metadata"
        central = dispatch_centralized(producer, consumer, local)
        checked = 0
        checksum = 0
        for p_name in [t.name for t in VARIED_TENSORS]:
            for s in consumer.local_samples(rank, p_name):
                want = torch.cat([full[p_name, s][a:b]
                                  for a, b in consumer.intervals(rank, p_name, s)])
                got = result.tensors[p_name][s]
                assert got.dtype == want.dtype and torch.equal(got, want), (prod, cons, p_name, s)
                assert torch.equal(central.tensors[p_name][s], want), \
                    ("central", prod, cons, p_name, s)
                checksum += int(want.to(torch.float64).abs().sum().item() * 1000) + want.numel()
                checked += 1
        # reductions over owners equal the single-process result
        num_groups = max(m.group_id for r in gathered for m in r) + 1
        rewards = owned_slices(consumer, "rewards", result.tensors.get("rewards", {}))
        ids = sorted(rewards)
        got = global_moments(torch.tensor([float(rewards[s]) for s in ids], dtype=torch.float64),
                             torch.tensor([s // 4 for s in ids], dtype=torch.long), num_groups,
                             unbiased=True)
        allr = torch.stack([full["rewards", s][0].double() for s in sorted(lengths)]).view(-1, 4)
        assert torch.allclose(got.mean, allr.mean(1), rtol=1e-12, atol=1e-12)
        assert torch.allclose(got.std, allr.std(1), rtol=1e-10, atol=1e-12)
        assert got.count.tolist() == [4.0] * num_groups
        adv = owned_slices(consumer, "advantages", result.tensors.get("advantages", {}))
        msk = owned_slices(consumer, "loss_mask", result.tensors.get("loss_mask", {}))
        mine = [adv[s].double()[msk[s].bool()] for s in sorted(adv)]
        vals = torch.cat(mine) if mine else torch.zeros(0, dtype=torch.float64)
        tok = global_moments(vals, torch.zeros(vals.numel(), dtype=torch.long), 1,
                             unbiased=False)
        ref = torch.cat([full["advantages", s].double()[full["loss_mask", s]]
                         for s in sorted(lengths)])
        assert tok.count.item() == ref.numel()
        assert abs(tok.mean.item() - ref.mean().item()) < 1e-12
        assert abs(tok.std.item() - ref.std(unbiased=False).item()) < 1e-12
        # a local tensor of the wrong size is refused before any message is posted
        if local:
            name = sorted(local)[0]
            s = sorted(local[name])[0]
            bad = {**local, name: {**local[name], s: local[name][s][:-1]}}
            try:
                execute_shard_map(smap, producer, consumer, bad)
                raise AssertionError("a short local tensor was accepted")
            except ValueError as e:
                assert f"local[{name!r}][{s}]" in str(e) and "producer placement" in str(e)
        report.append(dict(checked=checked, checksum=checksum, rounds=smap.rounds,
                           sent=result.stats.bytes_sent, received=result.stats.bytes_received,
                           messages=result.stats.messages, traffic=smap.traffic[rank]))
    report.append(_one_sample(seed))
    return report


def _one_sample(seed):
    """A batch of one sample on a dp-only layout: the ranks it does not land on still get every
    tensor's name, with nothing under it (callers index the result by name)."""
    import torch
    import torch.distributed as dist

    from earl_megatron.runtime.dispatcher import SampleMeta, dispatch, plan_dispatch
    rank, world = dist.get_rank(), dist.get_world_size()
    lay = ParallelLayout.parse(f"dp{world}", world)
    everyone = [[SampleMeta(0, 5, 0)]] + [[] for _ in range(world - 1)]
    producer, _, _ = plan_dispatch(lay, lay, everyone, VARIED_TENSORS)
    local = {}
    for p in producer.pieces_of(rank):
        local.setdefault(p.tensor, {})[p.sample_id] = \
            full_tensor(p.tensor, p.sample_id, 5, seed)[p.start:p.end]
    result, consumer, _ = dispatch(lay, lay, everyone[rank], local, VARIED_TENSORS)
    names = sorted(t.name for t in VARIED_TENSORS)
    assert sorted(result.tensors) == names, (rank, sorted(result.tensors))
    got = {n: sorted(result.tensors[n]) for n in names}
    want = {n: list(consumer.local_samples(rank, n)) for n in names}
    assert got == want, (rank, got, want)
    return dict(one_sample=sum(len(v) for v in got.values()))


def _expected_pieces(cases, world, seed):
    """(tensor, sample) pairs per rank that the pure plan places, computed in this process."""
    out = []
    for i, (prod, cons, mbs, _rpn, _lat, pp_stages) in enumerate(cases):
        P, C = ParallelLayout.parse(prod, world), ParallelLayout.parse(cons, world)
        lengths = lengths_for(seed + 97 * i, 4 * world)
        reports = [[(s, n) for s, n in lengths.items() if s % P.dp == P.coords(r).dp]
                   for r in range(world)]
        producer = producer_placement(P, reports, VARIED_TENSORS, pp_stages=pp_stages)
        consumer = consumer_placement(C, lengths, VARIED_TENSORS, mbs, producer=producer)
        out.append([len({(p.tensor, p.sample_id) for p in consumer.pieces_of(r)})
                    for r in range(world)])
    return out


@pytest.mark.parametrize("world,cases", [(4, CASES_4), (8, CASES_8)], ids=["4ranks", "8ranks"])
def test_dispatch_bit_identical_and_reductions(world, cases):
    seed = 1234
    per_rank = run_distributed(_run_cases, world, cases, seed, timeout=180, collective_timeout_s=60)
    expected = _expected_pieces(cases, world, seed)
    for i, case in enumerate(cases):
        reports = [per_rank[r][i] for r in range(world)]
        # every (tensor, sample) the pure consumer placement puts on a rank was checked there
        assert [rep["checked"] for rep in reports] == expected[i], case
        # executor bytes equal the shard map's accounting, and one buffer per peer per round
        assert [(rep["sent"], rep["received"]) for rep in reports] == \
            [tuple(rep["traffic"]) for rep in reports], case
        assert sum(rep["sent"] for rep in reports) == sum(rep["received"] for rep in reports)
    # fan-out cases (latency 0, several nodes) ran a second round somewhere
    assert any(per_rank[0][i]["rounds"] == 2 for i, c in enumerate(cases) if c[3])
    # the one sample's tensors landed on one rank; the others got every name, empty
    assert sorted(per_rank[r][-1]["one_sample"] > 0 for r in range(world)) == \
        [False] * (world - 1) + [True]
