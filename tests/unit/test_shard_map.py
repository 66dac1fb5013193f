"""Shard maps: exactly-once delivery, nothing to a holder, balanced sources, fan-out, and the
same plan from metadata in any order. An element-level replay here checks the invariants
independently of ``check_shard_map`` (which the tests also exercise)."""

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.placement import (Piece, Placement, TensorSpec,
                                          consumer_placement, placement_from_assignment,
                                          producer_placement)
from earl_megatron.plan.shard_map import (MissingDataError, Topology, Transfer,
                                          build_centralized_map, build_shard_map,
                                          check_shard_map)
from earl_megatron.testing.varied_tensors import VARIED_TENSORS

TOKENS = (TensorSpec("tokens", "int64", True, "first+last"),)


def replay(smap, producer, consumer, centralized=False):
    """Move elements one by one; return {(rank, tensor, sample, i): times received}."""
    def elems(pieces):
        return {(p.rank, p.tensor, p.sample_id, i) for p in pieces for i in range(p.start, p.end)}
    held = elems(producer.pieces)
    arrivals = Counter()
    for rnd in range(smap.rounds):
        new = []
        for t in (t for t in smap.transfers if t.round == rnd):
            assert t.src != t.dst
            assert t.nbytes == (t.end - t.start) * producer.spec[t.tensor].itemsize
            for i in range(t.start, t.end):
                assert (t.src, t.tensor, t.sample_id, i) in held, f"{t}: source lacks {i}"
                assert (t.dst, t.tensor, t.sample_id, i) not in held, f"{t}: dst holds {i}"
                new.append((t.dst, t.tensor, t.sample_id, i))
        arrivals.update(new)
        held |= set(new)
    missing = elems(consumer.pieces) - elems(producer.pieces)
    assert missing <= held, "a consumer element never arrived"
    if not centralized:
        assert set(arrivals) == missing, "data arrived where it is not needed"
        assert max(arrivals.values(), default=1) == 1, "an element arrived twice"
    return arrivals


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 4, 6, 8]))
    layouts = enumerate_layouts(world)
    prod, cons = draw(st.sampled_from(layouts)), draw(st.sampled_from(layouts))
    n = draw(st.integers(1, 3 * world))
    ids = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    lengths = {s: draw(st.integers(1, 40)) for s in ids}
    owner = {s: draw(st.integers(0, prod.dp - 1)) for s in ids}
    tensors = tuple(t for t in VARIED_TENSORS if draw(st.booleans())) or VARIED_TENSORS[:1]
    pp_stages = draw(st.sampled_from([None, {"tokens": "all"}, {"tokens": "first"}]))
    rpn = draw(st.sampled_from([0] + [d for d in range(1, world) if world % d == 0]))
    topo = Topology(ranks_per_node=rpn, latency_s=draw(st.sampled_from([0.0, 1e-5, 1.0])))
    reports = [[(s, lengths[s]) for s in ids if owner[s] == prod.coords(r).dp]
               for r in range(world)]
    producer = producer_placement(prod, reports, tensors, pp_stages=pp_stages)
    consumer = consumer_placement(cons, lengths, tensors, draw(st.integers(1, 3)))
    return producer, consumer, topo, reports, pp_stages


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**16))
def test_random_layouts_exactly_once_and_order_independent(case, seed):
    producer, consumer, topo, reports, pp_stages = case
    smap = build_shard_map(producer, consumer, topo)
    replay(smap, producer, consumer)
    check_shard_map(smap, producer, consumer)
    assert smap.bytes_moved <= 1.05 * smap.min_bytes
    assert smap.bytes_moved == smap.min_bytes  # no relay that does not need the data
    assert smap.inter_node_bytes >= smap.min_inter_node_bytes
    if smap.rounds == 2:  # fan-out taken: each element crosses into each node once
        assert smap.inter_node_bytes == smap.min_inter_node_bytes
        assert all(topo.node_of(t.src) == topo.node_of(t.dst)
                   for t in smap.transfers if t.round == 1)
    # another rank sees the metadata in another order, some of it twice: same plan
    rng = random.Random(seed)
    shuffled = [rng.sample(r, len(r)) + rng.sample(r, len(r) // 2) for r in reports]
    producer2 = producer_placement(producer.layout, shuffled, producer.tensors,
                                   pp_stages=pp_stages)
    pieces = list(consumer.pieces) * 2
    rng.shuffle(pieces)
    consumer2 = Placement(consumer.world_size, consumer.tensors,
                          tuple(rng.sample(consumer.lengths, len(consumer.lengths))),
                          tuple(pieces), consumer.micro_batches, consumer.layout)
    assert build_shard_map(producer2, consumer2, topo) == smap
    # fan-out forced off: one round, same bytes; the centralized baseline delivers too
    direct = build_shard_map(producer, consumer, topo, fan_out=False)
    assert direct.rounds == 1 and direct.bytes_moved == smap.bytes_moved
    central = build_centralized_map(producer, consumer)
    replay(central, producer, consumer, centralized=True)
    check_shard_map(central, producer, consumer, centralized=True)


def test_dp4_to_tp2_pp2_by_hand():
    # producer DP4: rank r holds sample r (10 tokens); consumer TP2xPP2: every rank needs all 4
    # samples' tokens (first and last pp_stage), nobody else.
    lengths = {s: 10 for s in range(4)}
    producer = producer_placement(ParallelLayout(dp=4), [[(r, 10)] for r in range(4)], TOKENS)
    consumer = consumer_placement(ParallelLayout(tp=2, pp=2), lengths, TOKENS)
    smap = build_shard_map(producer, consumer)
    # each rank receives the 3 samples it lacks, from their only holder: 12 transfers of 80 B
    assert len(smap.transfers) == 12 and smap.bytes_moved == smap.min_bytes == 12 * 80
    assert {(t.src, t.dst) for t in smap.transfers} == {(s, d) for s in range(4)
                                                         for d in range(4) if s != d}
    assert smap.traffic == ((240, 240),) * 4 and smap.busiest_rank_bytes == 480
    # centralized: rank 0 gathers 3 samples, then sends 3 to each of ranks 1..3
    central = build_centralized_map(producer, consumer)
    assert central.traffic[0] == (9 * 80, 3 * 80)
    assert central.busiest_rank_bytes == 12 * 80


def test_sources_balanced_among_replicas():
    # producer TP4xDP2 on 8 ranks: ranks 0-3 all hold the even samples, 4-7 the odd ones.
    lengths = {s: 16 for s in range(16)}
    prod = ParallelLayout(tp=4, dp=2)
    reports = [[(s, 16) for s in lengths if s % 2 == prod.coords(r).dp] for r in range(8)]
    producer = producer_placement(prod, reports, TOKENS)
    consumer = consumer_placement(ParallelLayout(dp=8), lengths, TOKENS)
    smap = build_shard_map(producer, consumer)
    check_shard_map(smap, producer, consumer)
    sent = [s for s, _ in smap.traffic]
    # 16 samples, 8 ranks need 2 each; what a rank lacks comes from the replica group that
    # holds it, spread so no replica sends more than one sample (128 B) above another
    for group in (sent[:4], sent[4:]):
        assert max(group) - min(group) <= 16 * 8, sent


def test_fan_out_crosses_nodes_once():
    # 2 nodes of 4. Producer DP8: rank r holds sample r. Consumer TP4xDP2: dp0 = ranks 0-3
    # (node 0) needs samples 0,2,4,6; dp1 = ranks 4-7 (node 1) needs 1,3,5,7.
    topo = Topology(ranks_per_node=4, latency_s=0.0)
    lengths = {s: 100 for s in range(8)}
    producer = producer_placement(ParallelLayout(dp=8), [[(r, 100)] for r in range(8)], TOKENS)
    consumer = consumer_placement(ParallelLayout(tp=4, dp=2), lengths, TOKENS)
    assert consumer.micro_batches == (((0, 2, 4, 6),), ((1, 3, 5, 7),))
    fan = build_shard_map(producer, consumer, topo)
    flat = build_shard_map(producer, consumer, topo, fan_out=False)
    for m in (fan, flat):
        replay(m, producer, consumer)
    # samples 4, 6 must enter node 0 and 1, 3 node 1: 4 crossings of 800 B at least
    assert fan.min_inter_node_bytes == flat.min_inter_node_bytes == 4 * 800
    assert fan.rounds == 2 and fan.inter_node_bytes == 4 * 800
    assert flat.rounds == 1 and flat.inter_node_bytes == 4 * 4 * 800
    assert fan.bytes_moved == flat.bytes_moved == fan.min_bytes
    # a relay forwards inside its node only
    assert all(t.src // 4 == t.dst // 4 for t in fan.transfers if t.round == 1)
    # default latency (10 us) against 800-B segments: fan-out not worth a round, not taken
    assert build_shard_map(producer, consumer, Topology(ranks_per_node=4)).rounds == 1


def test_nothing_moves_when_layouts_match():
    lengths = {s: 7 + s for s in range(6)}
    c = consumer_placement(ParallelLayout(tp=2, cp=2, dp=2), lengths, VARIED_TENSORS)
    smap = build_shard_map(c, c)
    assert smap.transfers == () and smap.min_bytes == 0 and smap.busiest_rank_bytes == 0


def test_errors_name_missing_data():
    producer = producer_placement(ParallelLayout(dp=2), [[(0, 5)], [(1, 5)]], TOKENS)
    consumer = consumer_placement(ParallelLayout(dp=2), {0: 5, 1: 5, 2: 5}, TOKENS)
    with pytest.raises(MissingDataError, match="sample 2 .*no such sample"):
        build_shard_map(producer, consumer)
    consumer = consumer_placement(ParallelLayout(dp=2), {0: 5, 1: 5}, VARIED_TENSORS[:2])
    with pytest.raises(MissingDataError, match="'loss_mask'"):
        build_shard_map(producer, consumer)
    # a producer pp_stage without the tensor: tokens only on pp_stage 0, consumer needs pp 1
    producer = placement_from_assignment(ParallelLayout(pp=2), [[[0]]], {0: 4}, TOKENS,
                                         pp_stages={"tokens": "first"})
    consumer = consumer_placement(ParallelLayout(tp=2), {0: 4}, TOKENS)
    assert build_shard_map(producer, consumer).bytes_moved == 32  # rank 1 gets it from 0
    # elements that no producer rank holds
    partial = Placement(2, TOKENS, ((0, 4),), (Piece(0, "tokens", 0, 0, 2),))
    with pytest.raises(MissingDataError, match=r"ranks \[0, 1\] need 'tokens' of sample 0 "
                                               r"elements \[2, 4\) but no producer rank"):
        build_shard_map(partial, consumer)


def test_check_shard_map_catches_a_duplicate():
    producer = producer_placement(ParallelLayout(dp=2), [[(0, 5)], [(1, 5)]], TOKENS)
    consumer = consumer_placement(ParallelLayout(tp=2), {0: 5, 1: 5}, TOKENS)
    smap = build_shard_map(producer, consumer)
    t = smap.transfers[0]
    bad = type(smap)(smap.world_size, smap.transfers + (Transfer(*vars(t).values()),),
                     smap.min_bytes, smap.min_inter_node_bytes, smap.topology)
    with pytest.raises(AssertionError):
        check_shard_map(bad, producer, consumer)
