"""Price a shard map on a cluster: predicted dispatch time at scales we cannot run (pure).

The cluster is a ``specs.ClusterSpec``, the selector's own description, in its units: NVLink
bandwidth per rank (``intra_node_bandwidth``), network bandwidth per NODE
(``inter_node_bandwidth``, shared by the node's ranks), one latency per message. The shard map
is built on ``topology_of(cluster)``, the per-rank view the planner's fan-out wants (the node's
network divided evenly among its ranks).

A dispatch is a sequence of rounds; in a round each rank posts one message per peer, and the
round ends when its slowest link is done. Links, all full duplex, busy for the bytes that cross
them in the round::

    NVLink of rank r      max(sent_intra_r, recv_intra_r) / intra_node_bandwidth
    network of node n     max(sum of inter-node bytes the node's ranks send, ... receive)
                          / inter_node_bandwidth            (contention: ranks share it)
    rank time   = latency x max(messages sent, received) + max(NVLink of r, network of r's node
                  if r has inter-node traffic in the round)
    round time  = max over ranks;  dispatch time = sum over rounds

Two centralized baselines, on the same map of bytes (rank 0 gathers one copy of everything the
consumers need, then scatters; data already in place is not re-sent, generous to both):
- ``gpu_root``: rank 0 is the root, on the links above (its node's network carries every byte
  that crosses nodes, twice);
- ``controller``: a single controller process on node 0 reached over TCP (what single-controller
  systems such as the EARL paper's baseline use): every byte passes through that process, at
  ``ControllerSpec.bandwidth`` in total (serialisation, one socket loop), and what comes from or
  goes to other nodes also crosses node 0's network; each message pays ``latency_s``.

Left out, deliberately: fabric contention beyond the node's own links (rail-optimised fat
trees), packing copies (HBM speed on GPUs) and the planner (measured by the benchmark).
``Comparison.speedup`` is 1.0 when neither strategy moves anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import TensorSpec, consumer_placement, producer_placement
from earl_megatron.plan.shard_map import (ShardMap, Topology, build_centralized_map,
                                          build_shard_map)
from earl_megatron.plan.specs import ClusterSpec, cluster_spec


@dataclass(frozen=True)
class ControllerSpec:
    """A controller process reached over TCP (an assumption; see docs/dispatcher.md)."""

    bandwidth: float = 25e9
    """Bytes/s the controller moves in total. Default: the line rate of a 200 Gbps node, as an
    object store with many TCP streams (Ray's) approaches; node 0's network, which every byte
    from another node crosses twice, is then the bottleneck. A plain Python socket loop with
    pickling moves 1-3 GB/s: pass that to price such a controller."""
    latency_s: float = 50e-6
    """Per message: a TCP round trip plus the controller's Python dispatch."""

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.latency_s >= 0):
            raise ValueError(f"ControllerSpec needs bandwidth > 0 and latency_s >= 0, got {self}")


def topology_of(cluster: ClusterSpec) -> Topology:
    """The per-rank view of ``cluster`` that shard-map building uses (fan-out decisions)."""
    return Topology(ranks_per_node=cluster.devices_per_node,
                    intra_node_Bps=cluster.intra_node_bandwidth,
                    inter_node_Bps=cluster.inter_node_bandwidth / cluster.devices_per_node,
                    latency_s=cluster.inter_node_latency_s if cluster.nodes > 1
                    else cluster.intra_node_latency_s)


def h100_cluster(nodes: int, inter_node_gbps: float = 200.0) -> ClusterSpec:
    """The EARL paper's cluster: 8 x H100 per node, ``inter_node_gbps`` Gbit/s per node."""
    return cluster_spec("h100", nodes=nodes, devices_per_node=8, inter_node_gbps=inter_node_gbps)


@dataclass(frozen=True)
class SimResult:
    seconds: float
    round_seconds: tuple[float, ...]
    busiest_rank: int
    busiest_rank_bytes: int
    """Bytes sent plus received by the rank that moves the most."""
    busiest_link: str
    """The link busiest over the whole dispatch: "nvlink r", "network node n" or "controller"."""
    busiest_link_seconds: float
    inter_node_bytes: int
    bytes_moved: int


def _latency(cluster: ClusterSpec) -> float:
    return cluster.inter_node_latency_s if cluster.nodes > 1 else cluster.intra_node_latency_s


def simulate(smap: ShardMap, cluster: ClusterSpec) -> SimResult:
    """Predicted wall time of ``smap`` on ``cluster`` (module docstring)."""
    node = cluster.node_of
    lat = _latency(cluster)
    rounds, busy = [], {}
    for rnd in range(smap.rounds):
        nvl: dict[int, list[int]] = {}       # rank -> [sent, received] over NVLink
        net: dict[int, list[int]] = {}       # node -> [sent, received] over its network
        crosses: set[int] = set()            # ranks with inter-node traffic this round
        peers_out: dict[int, set[int]] = {}
        peers_in: dict[int, set[int]] = {}
        for t in smap.transfers:
            if t.round != rnd:
                continue
            if node(t.src) == node(t.dst):
                nvl.setdefault(t.src, [0, 0])[0] += t.nbytes
                nvl.setdefault(t.dst, [0, 0])[1] += t.nbytes
            else:
                net.setdefault(node(t.src), [0, 0])[0] += t.nbytes
                net.setdefault(node(t.dst), [0, 0])[1] += t.nbytes
                crosses.update((t.src, t.dst))
            peers_out.setdefault(t.src, set()).add(t.dst)
            peers_in.setdefault(t.dst, set()).add(t.src)
        link_s = {f"nvlink {r}": max(v) / cluster.intra_node_bandwidth for r, v in nvl.items()}
        link_s.update({f"network node {n}": max(v) / cluster.inter_node_bandwidth
                       for n, v in net.items()})
        worst = 0.0
        for r in set(peers_out) | set(peers_in):
            msgs = max(len(peers_out.get(r, ())), len(peers_in.get(r, ())))
            wire = max(link_s.get(f"nvlink {r}", 0.0),
                       link_s.get(f"network node {node(r)}", 0.0) if r in crosses else 0.0)
            worst = max(worst, lat * msgs + wire)
        rounds.append(worst)
        for k, v in link_s.items():
            busy[k] = busy.get(k, 0.0) + v
    return _result(smap, cluster, rounds, busy)


def simulate_controller(smap: ShardMap, cluster: ClusterSpec,
                        controller: ControllerSpec = ControllerSpec()) -> SimResult:
    """``smap`` (a centralized map rooted at rank 0) with a TCP controller process on node 0 as
    the root: per round, every byte into or out of the root passes through the controller."""
    node = cluster.node_of
    rounds, busy = [], {}
    for rnd in range(smap.rounds):
        through = inter = 0
        peers: set[int] = set()      # one message per peer per round, as the executor posts
        for t in smap.transfers:
            if t.round != rnd or 0 not in (t.src, t.dst):
                continue
            through += t.nbytes
            peers.add(t.dst if t.src == 0 else t.src)
            if node(t.src) != node(t.dst):
                inter += t.nbytes
        msgs = len(peers)
        proc = through / controller.bandwidth
        nic = inter / cluster.inter_node_bandwidth
        rounds.append(msgs * controller.latency_s + max(proc, nic))
        busy["controller"] = busy.get("controller", 0.0) + proc
        busy["network node 0"] = busy.get("network node 0", 0.0) + nic
    return _result(smap, cluster, rounds, busy)


def _result(smap: ShardMap, cluster: ClusterSpec, rounds: list[float],
            busy: dict[str, float]) -> SimResult:
    traffic = smap.traffic
    busiest = max(range(smap.world_size), key=lambda r: (sum(traffic[r]), -r))
    link = max(sorted(busy), key=lambda k: busy[k]) if busy else "none"
    inter = sum(t.nbytes for t in smap.transfers if cluster.node_of(t.src) != cluster.node_of(t.dst))
    return SimResult(sum(rounds), tuple(rounds), busiest, sum(traffic[busiest]), link,
                     busy.get(link, 0.0), inter, smap.bytes_moved)


def _ratio(a: float, b: float) -> float:
    """a / b, with 0 / 0 = 1 (nothing moves either way) and x / 0 = inf."""
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


@dataclass(frozen=True)
class Comparison:
    decentralized: SimResult
    gpu_root: SimResult
    controller: SimResult
    min_bytes: int
    producer_dp: int

    @property
    def speedup(self) -> float:
        """Controller baseline (the paper's) over point to point."""
        return _ratio(self.controller.seconds, self.decentralized.seconds)

    @property
    def gpu_root_speedup(self) -> float:
        return _ratio(self.gpu_root.seconds, self.decentralized.seconds)

    @property
    def busiest_ratio(self) -> float:
        return _ratio(self.gpu_root.busiest_rank_bytes, self.decentralized.busiest_rank_bytes)


def compare_layouts(producer_layout: ParallelLayout, consumer_layout: ParallelLayout,
                    lengths: Mapping[int, int], cluster: ClusterSpec,
                    tensors: Sequence[TensorSpec], *, num_micro_batches: int = 1,
                    producer_pp_stages: Optional[Mapping[str, str]] = None,
                    controller: ControllerSpec = ControllerSpec()) -> Comparison:
    """All three strategies for one batch: samples go round-robin to producer DP ranks."""
    if cluster.world_size != producer_layout.world_size:
        raise ValueError(f"cluster has {cluster.world_size} ranks, layouts "
                         f"{producer_layout.world_size}: size the ClusterSpec to the layouts")
    world = producer_layout.world_size
    reports = [[(s, n) for s, n in sorted(lengths.items())
                if s % producer_layout.dp == producer_layout.coords(r).dp] for r in range(world)]
    producer = producer_placement(producer_layout, reports, tensors, pp_stages=producer_pp_stages)
    consumer = consumer_placement(consumer_layout, lengths, tensors, num_micro_batches,
                                  producer=producer)
    topo = topology_of(cluster)
    direct = build_shard_map(producer, consumer, topo)
    central = build_centralized_map(producer, consumer, 0, topo)
    return Comparison(simulate(direct, cluster), simulate(central, cluster),
                      simulate_controller(central, cluster, controller), direct.min_bytes,
                      producer_layout.dp)
