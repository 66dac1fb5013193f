"""Price a shard map on a model cluster: predicted dispatch time at scales we cannot run (pure).

The model is the one the executor implies. A dispatch is a sequence of rounds; in a round each
rank posts one message per peer, and a round ends when its slowest rank is done. Each rank has
two links per direction, a NIC (``inter_node_Bps``) to other nodes and NVLink
(``intra_node_Bps``) inside its node; they run concurrently, and sends and receives run
concurrently (full duplex), but the messages on one link in one direction are serialised::

    rank time  = latency_s * max(messages sent, messages received)
               + max(sent_inter, recv_inter) / inter_node_Bps  |  max(sent_intra, recv_intra)
                                                                  / intra_node_Bps  (the larger)
    round time = max over ranks;   dispatch time = sum over rounds

What it leaves out, deliberately: switch contention in the fabric (rail-optimised fat trees
carry per-GPU NIC traffic at line rate), packing copies (HBM-speed on GPUs), and the planner
(pure Python, measured separately by the benchmark). The centralized baseline is priced on the
same model, with rank 0 as the controller: every byte crosses rank 0's NIC twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import (RL_TENSORS, TensorSpec, consumer_placement,
                                          producer_placement)
from earl_megatron.plan.shard_map import (ShardMap, Topology, build_centralized_map,
                                          build_shard_map)

# One 8-GPU H100/H200 node per 8 ranks, 400 Gb/s NIC per GPU, NVLink 4.
H100_CLUSTER = Topology(ranks_per_node=8, intra_node_Bps=450e9, inter_node_Bps=50e9,
                        latency_s=10e-6)


@dataclass(frozen=True)
class SimResult:
    seconds: float
    round_seconds: tuple[float, ...]
    busiest_rank: int
    busiest_rank_bytes: int
    """Bytes sent plus received by the rank that moves the most."""
    inter_node_bytes: int
    bytes_moved: int


def simulate(smap: ShardMap, topology: Optional[Topology] = None) -> SimResult:
    """Predicted wall time of ``smap`` on ``topology`` (default: the map's own topology)."""
    topo = topology or smap.topology
    node = topo.node_of
    rounds = []
    for rnd in range(smap.rounds):
        # per rank: [sent_inter, recv_inter, sent_intra, recv_intra]; peers per direction
        load: dict[int, list[int]] = {}
        peers_out: dict[int, set[int]] = {}
        peers_in: dict[int, set[int]] = {}
        for t in smap.transfers:
            if t.round != rnd:
                continue
            intra = 2 if node(t.src) == node(t.dst) else 0
            load.setdefault(t.src, [0, 0, 0, 0])[intra] += t.nbytes
            load.setdefault(t.dst, [0, 0, 0, 0])[intra + 1] += t.nbytes
            peers_out.setdefault(t.src, set()).add(t.dst)
            peers_in.setdefault(t.dst, set()).add(t.src)
        worst = 0.0
        for r, (si, ri, sa, ra) in load.items():
            msgs = max(len(peers_out.get(r, ())), len(peers_in.get(r, ())))
            wire = max(max(si, ri) / topo.inter_node_Bps, max(sa, ra) / topo.intra_node_Bps)
            worst = max(worst, topo.latency_s * msgs + wire)
        rounds.append(worst)
    traffic = smap.traffic
    busiest = max(range(smap.world_size), key=lambda r: (sum(traffic[r]), -r))
    inter = sum(t.nbytes for t in smap.transfers if node(t.src) != node(t.dst))
    return SimResult(sum(rounds), tuple(rounds), busiest, sum(traffic[busiest]), inter,
                     smap.bytes_moved)


@dataclass(frozen=True)
class Comparison:
    decentralized: SimResult
    centralized: SimResult
    min_bytes: int
    producer_dp: int

    @property
    def speedup(self) -> float:
        return self.centralized.seconds / self.decentralized.seconds

    @property
    def busiest_ratio(self) -> float:
        return self.centralized.busiest_rank_bytes / self.decentralized.busiest_rank_bytes


def compare_layouts(producer_layout: ParallelLayout, consumer_layout: ParallelLayout,
                    lengths: Mapping[int, int], topology: Topology = H100_CLUSTER,
                    tensors: Sequence[TensorSpec] = RL_TENSORS, *, num_micro_batches: int = 1,
                    producer_pp_stages: Optional[Mapping[str, str]] = None) -> Comparison:
    """Both strategies for one batch: samples go round-robin to producer DP ranks."""
    world = producer_layout.world_size
    reports = [[(s, n) for s, n in sorted(lengths.items())
                if s % producer_layout.dp == producer_layout.coords(r).dp] for r in range(world)]
    producer = producer_placement(producer_layout, reports, tensors, pp_stages=producer_pp_stages)
    consumer = consumer_placement(consumer_layout, lengths, tensors, num_micro_batches,
                                  producer=producer)
    direct = build_shard_map(producer, consumer, topology)
    central = build_centralized_map(producer, consumer, 0, topology)
    return Comparison(simulate(direct, topology), simulate(central, topology), direct.min_bytes,
                      producer_layout.dp)
