"""The dispatch simulator: hand-computed times for small maps on shared links, and the trends."""


import pytest

from earl_megatron.plan.dispatch_sim import (ControllerSpec, compare_layouts, h100_cluster,
                                             simulate, simulate_controller, topology_of)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import TensorSpec, consumer_placement, producer_placement
from earl_megatron.plan.shard_map import build_centralized_map, build_shard_map
from earl_megatron.plan.specs import ClusterSpec

TOKENS = (TensorSpec("tokens", "int64", True, "first+last"),)
LOGPROBS = (TensorSpec("old_logprobs", "float32", True, "last"),)


def cluster(nodes, per_node, intra=1e9, inter=1e8, lat=1e-6):
    return ClusterSpec(nodes=nodes, devices_per_node=per_node, device_memory_bytes=10 ** 9,
                       peak_flops=1e12, hbm_bandwidth=1e11, intra_node_bandwidth=intra,
                       inter_node_bandwidth=inter, intra_node_latency_s=lat,
                       inter_node_latency_s=lat)


def dp4_to_tp2_pp2():
    # rank r holds sample r (10 tokens = 80 B); every rank needs all four samples
    producer = producer_placement(ParallelLayout(dp=4), [[(r, 10)] for r in range(4)], TOKENS)
    consumer = consumer_placement(ParallelLayout(tp=2, pp=2), {s: 10 for s in range(4)}, TOKENS)
    return producer, consumer


def test_one_node_by_hand():
    producer, consumer = dp4_to_tp2_pp2()
    cl = cluster(1, 4)
    res = simulate(build_shard_map(producer, consumer, topology_of(cl)), cl)
    # every rank sends 3 messages (240 B) and receives 3 (240 B), full duplex
    assert res.seconds == pytest.approx(3e-6 + 240 / 1e9)
    assert res.busiest_rank_bytes == 480 and res.bytes_moved == 960
    assert res.busiest_link.startswith("nvlink")
    central = build_centralized_map(producer, consumer, 0, topology_of(cl))
    root = simulate(central, cl)
    # round 0: rank 0 receives 3 x 80 B; round 1: rank 0 sends 3 x 240 B
    assert root.round_seconds == pytest.approx((3e-6 + 240 / 1e9, 3e-6 + 720 / 1e9))
    assert root.busiest_rank == 0 and root.busiest_rank_bytes == 960
    ctl = simulate_controller(central, cl, ControllerSpec(bandwidth=1e8, latency_s=1e-5))
    # the controller handles 3 messages per round, 240 B then 720 B, at 1e8 B/s
    assert ctl.round_seconds == pytest.approx((3e-5 + 240 / 1e8, 3e-5 + 720 / 1e8))
    assert ctl.busiest_link == "controller"


def test_two_nodes_share_the_node_network():
    producer, consumer = dp4_to_tp2_pp2()
    cl = cluster(2, 2)                                # network 1e8 B/s PER NODE
    res = simulate(build_shard_map(producer, consumer, topology_of(cl), fan_out=False), cl)
    # each rank sends 160 B to the other node; node 0's two ranks share its network: 320 B
    assert res.seconds == pytest.approx(3e-6 + 320 / 1e8)
    assert res.inter_node_bytes == 8 * 80 and res.busiest_link.startswith("network node")
    fan = simulate(build_shard_map(producer, consumer, topology_of(cl), fan_out=True), cl)
    # fan-out sends every sample across once (4 x 80 B) and within the node (4 x 80 B)
    assert fan.inter_node_bytes == 4 * 80 and fan.seconds < res.seconds
    # the same cluster with one rank per node has no one to share with
    assert topology_of(cl).inter_node_Bps == 1e8 / 2


def test_nothing_to_move_is_not_a_division_by_zero():
    lay = ParallelLayout(tp=8, dp=16)
    c = compare_layouts(lay, lay, {s: 1024 for s in range(32)}, h100_cluster(16), LOGPROBS)
    assert c.decentralized.bytes_moved == c.gpu_root.bytes_moved == 0
    assert c.speedup == c.gpu_root_speedup == c.busiest_ratio == 1.0


def test_controller_baseline_at_the_papers_scale():
    """128 ranks, logprobs only (the EARL paper's case; it measured 9.7-11.2x): a TCP controller
    is slower than a GPU root, and the ratio is tens, not the 117-186x that a private NIC per
    rank predicted; giving every rank its own node-sized NIC again inflates it."""
    cl = h100_cluster(16)
    prod, cons = ParallelLayout(tp=8, dp=16), ParallelLayout(tp=8, pp=4, dp=4)
    lengths = {s: 8192 for s in range(512)}
    c = compare_layouts(prod, cons, lengths, cl, LOGPROBS)
    assert c.decentralized.bytes_moved == c.min_bytes
    assert c.controller.seconds > c.gpu_root.seconds > c.decentralized.seconds
    assert 10 < c.speedup < 100 and c.decentralized.busiest_link.startswith("network node")
    private = compare_layouts(prod, cons, lengths, cl.with_(
        inter_node_bandwidth=8 * cl.inter_node_bandwidth), LOGPROBS)
    assert private.decentralized.seconds < c.decentralized.seconds


def test_cluster_size_must_match_the_layouts():
    lay = ParallelLayout(dp=8)
    with pytest.raises(ValueError, match="size the ClusterSpec"):
        compare_layouts(lay, lay, {0: 4}, h100_cluster(2), TOKENS)
