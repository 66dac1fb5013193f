"""Shard maps: the transfers that turn a producer placement into a consumer placement (pure).

A shard map is a sorted tuple of ``Transfer(round, src, dst, tensor, sample_id, start, end,
nbytes)``. Round 0 sends from producer holders; round 1 (only with fan-out) forwards what a
relay received in round 0 to the other ranks of its node. The executor sends ONE packed buffer
per (round, src, dst), the transfers of that pair concatenated in map order.

Layout-aware fan-out: when k >= 2 ranks of one node (say a TP group) need the same elements and
no rank of that node holds them, the elements cross the network once and are shared inside the
node: a scatter + all-gather, so each of the k ranks receives 1/k over the NIC and forwards it
to the other k-1 over NVLink (no single relay carries everything). Fan-out is on for a dispatch
when the NIC time it saves, summed over the dispatch, ``sum (k-1) * bytes * (1/inter -
1/intra)``, exceeds one round's latency::

    node 0 (producer)        node 1 (consumer TP4)      round 0: r0 -> r4 A[0:q)  r0 -> r5 A[q:2q)
      r0 holds sample A  ->    r4 r5 r6 r7 need A                r0 -> r6 A[2q:3q) r0 -> r7 A[3q:4q)
                                                        round 1: r4 -> r5 r6 r7 A[0:q), r5 -> ...

Invariants (``check_shard_map`` asserts them; the property tests call it):
- Exactly once: every element a consumer rank needs and does not already hold arrives at that
  rank exactly once; nothing else arrives (no transfer to a rank that holds or does not need it).
- A round-0 source holds the elements in the producer placement; a round-1 source received them
  in round 0. No transfer has src == dst.
- ``bytes_moved == min_bytes``: the payload any exactly-once plan must deliver. Fan-out does not
  add bytes (every relay needs the data itself); it cuts ``inter_node_bytes`` to
  ``min_inter_node_bytes``.
- Sources are balanced: among replicas that hold an element, same-node ones first, then the one
  that has sent the fewest bytes so far, ties by lower rank. Fan-out parts are rail-aligned
  instead (holder i sends to group member i), which is balanced when replicas match the group.
- Deterministic: a function of the two (canonical) placements and the topology only, so every
  rank computes the same map from the same gathered metadata, in any order.

``build_centralized_map`` expresses the single-controller baseline (gather every needed element
on ``root``, then scatter) in the same format, so one executor and one simulator serve both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from earl_megatron.plan.placement import Placement, merge_intervals, subtract_intervals


@dataclass(frozen=True)
class Topology:
    """A model cluster: nodes of ``ranks_per_node`` ranks; per-rank link speeds in bytes/s."""

    ranks_per_node: int = 0
    """Ranks per node; 0 means every rank is on one node (no fan-out)."""
    intra_node_Bps: float = 450e9
    """Per-rank NVLink bandwidth per direction (H100/H200: ~450 GB/s)."""
    inter_node_Bps: float = 50e9
    """Per-rank NIC bandwidth per direction (one 400 Gb/s NIC per GPU)."""
    latency_s: float = 10e-6
    """Fixed cost of one message (posting, rendezvous, wire latency)."""

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    def bandwidth(self, src: int, dst: int) -> float:
        same = self.node_of(src) == self.node_of(dst)
        return self.intra_node_Bps if same else self.inter_node_Bps


@dataclass(frozen=True, order=True)
class Transfer:
    round: int
    src: int
    dst: int
    tensor: str
    sample_id: int
    start: int
    end: int
    nbytes: int


@dataclass(frozen=True)
class ShardMap:
    world_size: int
    transfers: tuple[Transfer, ...]
    min_bytes: int
    """Bytes any exactly-once plan must deliver: needed-and-not-held elements, per rank."""
    min_inter_node_bytes: int
    """Bytes that must cross nodes: per node, needed elements that no rank of that node holds."""
    topology: Topology

    @property
    def rounds(self) -> int:
        return 1 + max((t.round for t in self.transfers), default=0)

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    @property
    def inter_node_bytes(self) -> int:
        node = self.topology.node_of
        return sum(t.nbytes for t in self.transfers if node(t.src) != node(t.dst))

    @cached_property
    def traffic(self) -> tuple[tuple[int, int], ...]:
        """(bytes sent, bytes received) per rank, all rounds."""
        sent = [0] * self.world_size
        recv = [0] * self.world_size
        for t in self.transfers:
            sent[t.src] += t.nbytes
            recv[t.dst] += t.nbytes
        return tuple(zip(sent, recv))

    @property
    def busiest_rank_bytes(self) -> int:
        return max((s + r for s, r in self.traffic), default=0)

    @cached_property
    def _messages(self) -> dict[tuple[int, int, int], tuple[Transfer, ...]]:
        out: dict[tuple[int, int, int], list[Transfer]] = {}
        for t in self.transfers:  # already in map order: (round, src, dst, tensor, sample, start)
            out.setdefault((t.round, t.src, t.dst), []).append(t)
        return {k: tuple(v) for k, v in out.items()}

    def sends(self, rank: int, rnd: int) -> dict[int, tuple[Transfer, ...]]:
        """dst -> the transfers ``rank`` packs into its one buffer for dst in round ``rnd``."""
        return {d: ts for (r, s, d), ts in self._messages.items() if r == rnd and s == rank}

    def recvs(self, rank: int, rnd: int) -> dict[int, tuple[Transfer, ...]]:
        return {s: ts for (r, s, d), ts in self._messages.items() if r == rnd and d == rank}


class MissingDataError(ValueError):
    pass


def _check_compatible(producer: Placement, consumer: Placement) -> None:
    if producer.world_size != consumer.world_size:
        raise ValueError(f"producer world {producer.world_size} != consumer world "
                         f"{consumer.world_size}; both placements must span the same ranks")
    for name, spec in consumer.spec.items():
        if name not in producer.spec:
            raise MissingDataError(f"consumer needs tensor {name!r} but the producer placement "
                                   f"has only {list(producer.spec)}; produce it or drop it")
        if producer.spec[name] != spec:
            raise ValueError(f"tensor {name!r} differs: producer {producer.spec[name]} vs "
                             f"consumer {spec}; use one TensorSpec for both")
    for s, n in consumer.lengths:
        if producer.length_of.get(s) != n:
            has = (f"length {producer.length_of[s]}" if s in producer.length_of
                   else "no such sample")
            raise MissingDataError(f"consumer needs sample {s} (length {n}) but the producer has "
                                   f"{has}; plan both from the same metadata")


def _segments(producer: Placement, consumer: Placement, name: str, s: int):
    """Yield (start, end, holders, dsts) over the elementary segments of (tensor, sample) that
    some consumer rank needs and does not hold: holders are the producer ranks holding all of
    [start, end), dsts the consumer ranks missing it, both ascending."""
    needs: dict[int, list[tuple[int, int]]] = {}
    for p in consumer.holders(name, s):
        needs.setdefault(p.rank, []).append((p.start, p.end))
    missing = {}
    for r, ivs in needs.items():
        rest = subtract_intervals(merge_intervals(ivs), producer.intervals(r, name, s))
        if rest:
            missing[r] = rest
    if not missing:
        return
    src = [(p.start, p.end, p.rank) for p in producer.holders(name, s)]
    cuts = sorted({x for a, b, _ in src for x in (a, b)}
                  | {x for ivs in missing.values() for a, b in ivs for x in (a, b)})
    for a, b in zip(cuts, cuts[1:]):
        dsts = [r for r, ivs in missing.items() if any(c <= a and b <= d for c, d in ivs)]
        if not dsts:
            continue
        holders = sorted({r for c, d, r in src if c <= a and b <= d})
        if not holders:
            raise MissingDataError(f"ranks {sorted(dsts)} need {name!r} of sample {s} elements "
                                   f"[{a}, {b}) but no producer rank holds them")
        yield a, b, holders, sorted(dsts)


def build_shard_map(producer: Placement, consumer: Placement,
                    topology: Optional[Topology] = None, *,
                    fan_out: Optional[bool] = None) -> ShardMap:
    """Transfers from ``producer`` holders to ``consumer`` ranks (invariants: module docstring).

    ``fan_out`` None decides from the topology; True or False forces it (benchmarks, tests).
    """
    topo = topology or Topology()
    _check_compatible(producer, consumer)
    node = topo.node_of
    sent = [0] * producer.world_size
    recv = [0] * producer.world_size
    raw: list[Transfer] = []
    min_bytes = min_inter = 0

    def pick(cands, load):
        return min(cands, key=lambda r: (load[r], r))

    segs = []
    for spec in consumer.tensors:
        for s in consumer.sample_ids:
            for a, b, holders, dsts in _segments(producer, consumer, spec.name, s):
                by_node: dict[int, list[int]] = {}
                for d in dsts:
                    by_node.setdefault(node(d), []).append(d)
                segs.append((spec, s, a, b, holders, sorted(by_node.items())))

    # Fan-out adds one round, whose latency is paid once per dispatch, not per segment: turn it
    # on when the NIC time it saves over the whole dispatch exceeds that latency.
    gain = 1 / topo.inter_node_Bps - 1 / topo.intra_node_Bps
    saved = sum((len(group) - 1) * (b - a) * spec.itemsize * gain
                for spec, _, a, b, holders, groups in segs for n, group in groups
                if len(group) > 1 and not any(node(h) == n for h in holders))
    if fan_out is None:
        fan_out = gain > 0 and saved > topo.latency_s

    for spec, s, a, b, holders, groups in segs:
        nbytes = (b - a) * spec.itemsize
        for n, group in groups:
            min_bytes += nbytes * len(group)
            local = [h for h in holders if node(h) == n]
            if not local:
                min_inter += nbytes
            if fan_out and not local and len(group) > 1:
                # scatter + all-gather: part j crosses the NIC once, to group[j], which then
                # forwards it to the rest of the node; every member relays an equal share
                k = len(group)
                cuts = [a + j * (b - a) // k for j in range(k + 1)]
                hops = []
                # least-loaded first, so short segments (a reward: one element) rotate relays
                for j, relay in enumerate(sorted(group, key=lambda r: (recv[r], r))):
                    x, y = cuts[j], cuts[j + 1]
                    if x < y:
                        # rail-aligned source (i-th holder -> i-th member): the same pairs
                        # recur across samples, so they coalesce into few messages
                        hops.append((0, holders[group.index(relay) % len(holders)], relay, x, y))
                        hops += [(1, relay, d, x, y) for d in group if d != relay]
            else:
                hops = [(0, None, d, a, b) for d in group]
            for rnd, src, dst, x, y in hops:
                if src is None:  # chosen one by one, so one group's dsts spread out
                    src = pick(local or holders, sent)
                n_bytes = (y - x) * spec.itemsize
                sent[src] += n_bytes
                recv[dst] += n_bytes
                raw.append(Transfer(rnd, src, dst, spec.name, s, x, y, n_bytes))
    return ShardMap(producer.world_size, _merge(raw), min_bytes, min_inter, topo)


def build_centralized_map(producer: Placement, consumer: Placement, root: int = 0,
                          topology: Optional[Topology] = None) -> ShardMap:
    """The single-controller baseline: round 0 gathers one copy of every element the consumer
    needs on ``root`` (from the least-loaded holder), round 1 scatters from ``root`` to every
    consumer rank what it needs and does not hold. Generous to the baseline: data already in
    place is not re-sent, as in the decentralized map."""
    topo = topology or Topology()
    _check_compatible(producer, consumer)
    sent = [0] * producer.world_size
    raw: list[Transfer] = []
    min_bytes = min_inter = 0
    node = topo.node_of
    for spec in consumer.tensors:
        for s in consumer.sample_ids:
            segs = list(_segments(producer, consumer, spec.name, s))
            for a, b, holders, dsts in segs:
                nbytes = (b - a) * spec.itemsize
                min_bytes += nbytes * len(dsts)
                for n in sorted({node(d) for d in dsts}):
                    if not any(node(h) == n for h in holders):
                        min_inter += nbytes
                if root not in holders:
                    src = min(holders, key=lambda r: (sent[r], r))
                    sent[src] += nbytes
                    raw.append(Transfer(0, src, root, spec.name, s, a, b, nbytes))
                raw.extend(Transfer(1, root, d, spec.name, s, a, b, nbytes)
                           for d in dsts if d != root)
    return ShardMap(producer.world_size, _merge(raw), min_bytes, min_inter, topo)


def _order(t: Transfer) -> tuple:
    return (t.round, t.src, t.dst, t.tensor, t.sample_id, t.start, t.end, t.nbytes)


def _merge(raw: list[Transfer]) -> tuple[Transfer, ...]:
    """Sort and join contiguous ranges of one (round, src, dst, tensor, sample)."""
    out: list[Transfer] = []
    for t in sorted(raw, key=_order):  # a tuple key: dataclass __lt__ is 5x slower
        last = out[-1] if out else None
        if (last and (last.round, last.src, last.dst, last.tensor, last.sample_id)
                == (t.round, t.src, t.dst, t.tensor, t.sample_id) and last.end == t.start):
            out[-1] = Transfer(t.round, t.src, t.dst, t.tensor, t.sample_id, last.start, t.end,
                               last.nbytes + t.nbytes)
        else:
            out.append(t)
    return tuple(out)


def check_shard_map(smap: ShardMap, producer: Placement, consumer: Placement,
                    *, centralized: bool = False) -> None:
    """Assert the invariants of the module docstring; raise AssertionError naming the first
    violation. ``centralized`` relaxes 'nothing to a holder or non-needer' for the root."""
    held = {}  # (rank, tensor, sample) -> intervals currently held
    for p in producer.pieces:
        held.setdefault((p.rank, p.tensor, p.sample_id), []).append((p.start, p.end))
    got: dict[tuple[int, str, int], list[tuple[int, int]]] = {}
    for rnd in range(smap.rounds):
        arrivals = []
        for t in smap.transfers:
            if t.round != rnd:
                continue
            assert t.src != t.dst, f"self transfer {t}"
            have = merge_intervals(held.get((t.src, t.tensor, t.sample_id), []))
            assert not subtract_intervals([(t.start, t.end)], have), \
                f"{t}: source does not hold [{t.start}, {t.end}) in round {rnd}"
            mine = merge_intervals(held.get((t.dst, t.tensor, t.sample_id), []))
            assert not subtract_intervals(mine, subtract_intervals(mine, [(t.start, t.end)])), \
                f"{t}: sent to a rank that already holds part of it"
            arrivals.append(t)
        for t in arrivals:
            held.setdefault((t.dst, t.tensor, t.sample_id), []).append((t.start, t.end))
            got.setdefault((t.dst, t.tensor, t.sample_id), []).append((t.start, t.end))
    need = {}
    for p in consumer.pieces:
        need.setdefault((p.rank, p.tensor, p.sample_id), []).append((p.start, p.end))
    for key, ivs in need.items():
        want = subtract_intervals(merge_intervals(ivs),
                                  producer.intervals(key[0], key[1], key[2]))
        recvd = sorted(got.get(key, []))
        total = sum(b - a for a, b in recvd)
        assert merge_intervals(recvd) == want or (centralized and not subtract_intervals(
            want, merge_intervals(recvd))), f"{key}: needs {want}, received {recvd}"
        if not centralized:
            assert total == sum(b - a for a, b in want), f"{key}: received {recvd} (duplicates)"
    if not centralized:
        extra = set(got) - set(need)
        assert not extra, f"data sent to ranks that do not need it: {sorted(extra)[:3]}"
        assert smap.bytes_moved == smap.min_bytes, (smap.bytes_moved, smap.min_bytes)
