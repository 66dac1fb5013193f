"""Placements: CP load-balanced chunks, token-balanced assignment, replication, canonical form."""

import random
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.placement import (Piece, Placement, TensorSpec,
                                          assign_samples, consumer_placement, cp_chunks,
                                          merge_intervals, producer_placement,
                                          subtract_intervals)
from earl_megatron.testing.varied_tensors import VARIED_TENSORS


def test_cp_chunks_match_megatron_load_balanced_split():
    # length 16, cp=2: chunks [0:4) [4:8) [8:12) [12:16); cp rank 0 holds 0 and 3, rank 1 holds 1, 2
    assert cp_chunks(16, 2, 0) == [(0, 4), (12, 16)]
    assert cp_chunks(16, 2, 1) == [(4, 12)]
    assert cp_chunks(16, 1, 0) == [(0, 16)]
    # cp=4: 8 chunks of 2; rank 1 holds chunks 1 and 6
    assert cp_chunks(16, 4, 1) == [(2, 4), (12, 14)]
    # shorter than 2*cp: empty chunks are dropped
    assert cp_chunks(1, 2, 0) == [(0, 1)] and cp_chunks(1, 2, 1) == []


@given(length=st.integers(0, 500), cp=st.sampled_from([1, 2, 3, 4, 8]))
def test_cp_chunks_partition_the_sequence(length, cp):
    ivs = [iv for r in range(cp) for iv in cp_chunks(length, cp, r)]
    assert sum(b - a for a, b in ivs) == length
    assert merge_intervals(ivs) == ([(0, length)] if length else [])
    if length % (2 * cp) == 0:  # equal work per cp rank when Megatron's padding holds
        assert {sum(b - a for a, b in cp_chunks(length, cp, r)) for r in range(cp)} == \
            {length // cp}


def test_interval_helpers():
    assert merge_intervals([(5, 7), (0, 2), (2, 3), (6, 9)]) == [(0, 3), (5, 9)]
    assert subtract_intervals([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert subtract_intervals([(0, 4)], []) == [(0, 4)]


def test_assign_samples_longest_first_greedy():
    lengths = {0: 10, 1: 9, 2: 8, 3: 1, 4: 1}
    # 0 -> dp0 (10), 1 -> dp1 (9), 2 -> dp1 (17), 3 -> dp0 (11), 4 -> dp0 (12)
    assert assign_samples(lengths, 2) == (((0, 3, 4),), ((1, 2),))
    # micro-batches inside each DP rank by the same rule
    assert assign_samples(lengths, 1, 2) == (((0, 3, 4), (1, 2)),)
    # ties: equal lengths go by sample id, to the lower rank first
    assert assign_samples({7: 5, 3: 5, 5: 5, 1: 5}, 2) == (((1, 5),), ((3, 7),))
    with pytest.raises(ValueError, match="must be >= 1"):
        assign_samples(lengths, 0)


@given(lengths=st.lists(st.integers(1, 1000), min_size=1, max_size=40),
       dp=st.integers(1, 8), mbs=st.integers(1, 3))
def test_assignment_is_a_token_balanced_partition(lengths, dp, mbs):
    lens = dict(enumerate(lengths))
    a = assign_samples(lens, dp, mbs)
    flat = [s for d in a for mb in d for s in mb]
    assert sorted(flat) == sorted(lens)  # every sample once
    loads = [sum(lens[s] for mb in d for s in mb) for d in a]
    assert max(loads) - min(loads) <= max(lengths)  # greedy LPT bound


def test_consumer_tp2_pp2_replication_and_pp_stage_needs():
    lengths = {0: 6, 1: 4}
    c = consumer_placement(ParallelLayout(tp=2, pp=2), lengths, VARIED_TENSORS)
    # pp_stage 0 (ranks 0, 1) holds only token ids; pp_stage 1 (ranks 2, 3) holds everything
    for r in (0, 1):
        assert c.pieces_of(r) == [Piece(r, "tokens", 0, 0, 6), Piece(r, "tokens", 1, 0, 4)]
    for r in (2, 3):
        assert {p.tensor for p in c.pieces_of(r)} == {t.name for t in VARIED_TENSORS}
        assert c.intervals(r, "rewards", 1) == [(0, 1)]          # per-sample tensor
        assert c.intervals(r, "old_logprobs", 0) == [(0, 6)]
    assert c.micro_batches == (((0, 1),),)
    # tokens on first+last, other per-token tensors on last only: 2*(6+4)*8 + 2*(6+4)*(1+4+4+4)
    # + 2 samples * 2 ranks * 4 bytes of reward
    assert sum(c.nbytes(p) for p in c.pieces) == 4 * 10 * 8 + 2 * 10 * 13 + 2 * 2 * 4


def test_consumer_cp2_dp2_split():
    c = consumer_placement(ParallelLayout(cp=2, dp=2), {0: 8, 1: 8, 2: 4}, VARIED_TENSORS[:1])
    # dp0 gets 0 and 2 (8 + 4 tokens), dp1 gets 1; rank = cp + 2*dp
    assert c.micro_batches == (((0, 2),), ((1,),))
    assert c.intervals(0, "tokens", 0) == [(0, 2), (6, 8)]
    assert c.intervals(1, "tokens", 0) == [(2, 6)]
    assert c.intervals(0, "tokens", 2) == [(0, 1), (3, 4)]
    assert c.intervals(3, "tokens", 1) == [(2, 6)]


def test_canonical_form_ignores_order_and_duplicates():
    lengths = {s: 10 + s for s in range(6)}
    c = consumer_placement(ParallelLayout(tp=2, cp=2, dp=2), lengths, VARIED_TENSORS)
    pieces = list(c.pieces) + random.Random(0).sample(list(c.pieces), 20)
    random.Random(1).shuffle(pieces)
    lens = list(c.lengths) * 2
    random.Random(2).shuffle(lens)
    again = Placement(c.world_size, c.tensors, tuple(lens), tuple(pieces), c.micro_batches,
                      c.layout)
    assert again == c and hash(again) == hash(c)
    # split pieces merge back
    split = [Piece(0, "tokens", 0, 0, 3), Piece(0, "tokens", 0, 3, 10)]
    p = Placement(1, VARIED_TENSORS[:1], ((0, 10),), tuple(split))
    assert p.pieces == (Piece(0, "tokens", 0, 0, 10),)


def test_producer_placement_from_reports():
    layout = ParallelLayout(tp=2, dp=2)  # ranks 0,1 = dp0; 2,3 = dp1
    reports = [[(0, 5), (2, 7)], [(2, 7)], [(1, 3)], []]
    p = producer_placement(layout, reports, VARIED_TENSORS[:2])
    # union per DP replica, replicated on both tp ranks
    assert p.local_samples(1, "tokens") == [0, 2] and p.local_samples(3, "tokens") == [1]
    shuffled = [list(reversed(r)) * 2 for r in reports]
    assert producer_placement(layout, shuffled, VARIED_TENSORS[:2]) == p
    with pytest.raises(ValueError, match="lengths 5 and 6"):
        producer_placement(layout, [[(0, 5)], [(0, 6)], [], []], VARIED_TENSORS)
    with pytest.raises(ValueError, match="DP ranks 0 and 1"):
        producer_placement(layout, [[(0, 5)], [], [(0, 5)], []], VARIED_TENSORS)
    with pytest.raises(ValueError, match="one \\(possibly empty\\) report per rank"):
        producer_placement(layout, [[]], VARIED_TENSORS)
    # a producer that holds tokens on every pp_stage (a rollout broadcasts its output)
    pp = producer_placement(ParallelLayout(pp=2), [[(0, 4)], [(0, 4)]], VARIED_TENSORS[:2],
                            pp_stages={"tokens": "all"})
    assert pp.intervals(0, "tokens", 0) == pp.intervals(1, "tokens", 0) == [(0, 4)]
    assert pp.intervals(0, "loss_mask", 0) == [] and pp.intervals(1, "loss_mask", 0) == [(0, 4)]


def test_owned_intervals_count_each_element_once():
    c = consumer_placement(ParallelLayout(tp=2, cp=2), {0: 8}, VARIED_TENSORS)
    # ranks 0,1 = cp0 (tp replicas), ranks 2,3 = cp1: the lower tp rank owns
    assert c.owned_intervals(0, "old_logprobs", 0) == [(0, 2), (6, 8)]
    assert c.owned_intervals(1, "old_logprobs", 0) == []
    assert c.owned_intervals(2, "old_logprobs", 0) == [(2, 6)]
    owned = sum(b - a for r in range(4) for a, b in c.owned_intervals(r, "old_logprobs", 0))
    assert owned == 8


def test_validation_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        TensorSpec("x", "float8")
    with pytest.raises(ValueError, match="pp_stages='middle'"):
        TensorSpec("x", "float32", pp_stages="middle")
    spec = (TensorSpec("x", "float32"),)
    with pytest.raises(ValueError, match="not a non-empty range inside \\[0, 4\\)"):
        Placement(2, spec, ((0, 4),), (Piece(0, "x", 0, 2, 5),))
    with pytest.raises(ValueError, match="names tensor 'y'"):
        Placement(2, spec, ((0, 4),), (Piece(0, "y", 0, 0, 1),))
    with pytest.raises(ValueError, match="rank outside world size 2"):
        Placement(2, spec, ((0, 4),), (Piece(2, "x", 0, 0, 1),))
    with pytest.raises(ValueError, match="two different lengths"):
        Placement(2, spec, ((0, 4), (0, 5)), ())
    with pytest.raises(ValueError, match="has dp=2"):
        from earl_megatron.plan.placement import placement_from_assignment
        placement_from_assignment(ParallelLayout(dp=2), [[[0]]], {0: 3}, VARIED_TENSORS)


def test_planning_modules_import_neither_torch_nor_megatron():
    code = ("import sys, earl_megatron.plan.placement, earl_megatron.plan.shard_map, "
            "earl_megatron.plan.dispatch_sim; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_locality_preference_never_costs_balance():
    # 4 equal samples, consumer DP2: plain greedy alternates, 0, 2 on dp0 and 1, 3 on dp1.
    # Producer DP2 holds 0, 1 on dp0 and 2, 3 on dp1: given the producer, nothing moves.
    lengths = {s: 10 for s in range(4)}
    assert assign_samples(lengths, 2) == (((0, 2),), ((1, 3),))
    producer = producer_placement(ParallelLayout(dp=2), [[(0, 10), (1, 10)], [(2, 10), (3, 10)]],
                                  VARIED_TENSORS)
    c = consumer_placement(ParallelLayout(dp=2), lengths, VARIED_TENSORS, producer=producer)
    assert c.micro_batches == (((0, 1),), ((2, 3),))
    assert c.pieces == producer.pieces
    # plain greedy's busiest DP rank has 11 tokens; sample 1 on dp0 (after 0) would make it 20,
    # so that preference is ignored, while 0 and 2 follow theirs
    assert assign_samples({0: 10, 1: 10, 2: 1}, 2) == (((0, 2),), ((1,),))
    assert assign_samples({0: 10, 1: 10, 2: 1}, 2, prefer={0: 0, 1: 0, 2: 1}) == \
        (((0,),), ((1, 2),))


@given(lengths=st.lists(st.integers(1, 1000), min_size=1, max_size=30), dp=st.integers(1, 6),
       prefs=st.lists(st.integers(0, 5), min_size=30, max_size=30))
def test_locality_keeps_the_busiest_dp_rank(lengths, dp, prefs):
    lens = dict(enumerate(lengths))
    prefer = {s: prefs[s] % dp for s in lens}

    def busiest(a):
        return max(sum(lens[s] for mb in d for s in mb) for d in a)
    with_pref = assign_samples(lens, dp, prefer=prefer)
    assert sorted(s for d in with_pref for mb in d for s in mb) == sorted(lens)
    assert busiest(with_pref) <= busiest(assign_samples(lens, dp))


def test_a_pool_placement_shifted_onto_the_world():
    from earl_megatron.plan.placement import TensorSpec, consumer_placement

    specs = (TensorSpec("tokens", "int64"),)
    p = consumer_placement(ParallelLayout(dp=2), {0: 4, 1: 6}, specs)
    q = p.shifted(2, 4)
    assert q.world_size == 4 and q.lengths == p.lengths
    assert [(x.rank - 2, x.sample_id) for x in q.pieces] == [(x.rank, x.sample_id)
                                                            for x in p.pieces]
    assert q.micro_batches == p.micro_batches
    with pytest.raises(ValueError, match="does not fit a world of 3"):
        p.shifted(2, 3)
