"""The dispatch simulator: hand-computed times for small maps, and the trends at scale."""

import pytest

from earl_megatron.plan.dispatch_sim import H100_CLUSTER, compare_layouts, simulate
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import TensorSpec, consumer_placement, producer_placement
from earl_megatron.plan.shard_map import Topology, build_centralized_map, build_shard_map

TOKENS = (TensorSpec("tokens", "int64", True, "first+last"),)


def dp4_to_tp2_pp2():
    # rank r holds sample r (10 tokens = 80 B); every rank needs all four samples
    producer = producer_placement(ParallelLayout(dp=4), [[(r, 10)] for r in range(4)], TOKENS)
    consumer = consumer_placement(ParallelLayout(tp=2, pp=2), {s: 10 for s in range(4)}, TOKENS)
    return producer, consumer


def test_one_node_by_hand():
    producer, consumer = dp4_to_tp2_pp2()
    topo = Topology(ranks_per_node=0, intra_node_Bps=1e9, latency_s=1e-6)
    res = simulate(build_shard_map(producer, consumer, topo))
    # every rank sends 3 messages (240 B) and receives 3 (240 B), full duplex
    assert res.seconds == pytest.approx(3e-6 + 240 / 1e9)
    assert res.busiest_rank_bytes == 480 and res.bytes_moved == 960
    central = simulate(build_centralized_map(producer, consumer, 0, topo))
    # round 0: rank 0 receives 3 x 80 B; round 1: rank 0 sends 3 x 240 B
    assert central.round_seconds == pytest.approx((3e-6 + 240 / 1e9, 3e-6 + 720 / 1e9))
    assert central.busiest_rank == 0 and central.busiest_rank_bytes == 960


def test_two_nodes_by_hand():
    producer, consumer = dp4_to_tp2_pp2()
    topo = Topology(ranks_per_node=2, intra_node_Bps=1e9, inter_node_Bps=1e8, latency_s=1e-6)
    res = simulate(build_shard_map(producer, consumer, topo, fan_out=False))
    # rank 0 sends 80 B to rank 1 over NVLink and 160 B to ranks 2, 3 over its NIC
    assert res.seconds == pytest.approx(3e-6 + 160 / 1e8)
    assert res.inter_node_bytes == 8 * 80
    fan = simulate(build_shard_map(producer, consumer, topo, fan_out=True))
    # round 0 sends every sample across once (4 x 80 B) and within the node (4 x 80 B)
    assert fan.inter_node_bytes == 4 * 80 and len(fan.round_seconds) == 2


def test_decentralized_wins_more_with_scale_and_context():
    def cmp(world, ctx):
        prod = ParallelLayout(tp=8, dp=world // 8)
        cons = ParallelLayout(tp=8, pp=4, dp=world // 32)
        return compare_layouts(prod, cons, {s: ctx for s in range(2 * prod.dp)}, H100_CLUSTER)
    small, long_ctx, big = cmp(128, 1024), cmp(128, 32768), cmp(1024, 1024)
    for c in (small, long_ctx, big):
        assert c.decentralized.bytes_moved == c.min_bytes
        assert c.centralized.busiest_rank == 0
    assert 1 < small.speedup < long_ctx.speedup      # latency matters less at long context
    assert small.speedup < big.speedup                # rank 0's NIC carries 8x more at 1,024
    assert big.busiest_ratio > 4 * small.busiest_ratio
    # decentralized time does not grow with world size at a fixed batch per rank
    assert big.decentralized.seconds == pytest.approx(small.decentralized.seconds, rel=0.05)
