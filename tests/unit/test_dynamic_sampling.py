"""DAPO's dynamic sampling rule (plan/dynamic_sampling.py) and its pool helpers
(trainer/dynamic_pool.py), in one process: a group of equal rewards drops, the extra rounds stop
at the cap or the quota, a refill at k >= 1 stays within (k + 1) x the replica's quota, extra
groups get keys and seeds no other round or replica of the iteration has, and the counts add
up."""

from dataclasses import dataclass
from typing import Optional

import pytest

from earl_megatron.plan.dynamic_sampling import (DynamicCounts, extra_group_index, has_signal,
                                                 refill)
from earl_megatron.seeds import ITERATION_STRIDE, rollout_sample_seed, round_sample_seed
from earl_megatron.trainer.dynamic_pool import drop_flat, group_rewards


def test_a_group_of_equal_rewards_has_no_signal():
    assert not has_signal([1.0, 1.0])
    assert not has_signal([-1.0, -1.0, -1.0])
    assert has_signal([1.0, 0.0])
    assert has_signal([0.1, 0.1, 0.2])
    assert not has_signal([0.5])   # one episode: no group baseline to differ from


def test_refill_k0_replaces_exactly_the_dropped_groups():
    # quota 4 at k = 0 (target 4): 1 group with signal kept, 3 dropped -> 3 new
    assert refill(4, signal=1, held=1, target=4, rounds_played=0, max_rounds=4) == 3
    assert refill(4, signal=3, held=3, target=4, rounds_played=2, max_rounds=4) == 1


def test_refill_stops_at_the_quota_and_at_the_cap():
    assert refill(4, signal=4, held=4, target=4, rounds_played=0, max_rounds=4) == 0
    assert refill(4, signal=0, held=0, target=4, rounds_played=4, max_rounds=4) == 0
    assert refill(4, signal=0, held=0, target=4, rounds_played=0, max_rounds=0) == 0
    # a replica that keeps drawing flat groups plays exactly max_rounds extra rounds
    rounds, signal = 0, 0
    while refill(2, signal, signal, 2, rounds, 3):
        rounds += 1
    assert rounds == 3


def test_refill_at_k1_fills_freed_slots_within_the_bound():
    quota, k = 3, 1
    target = (k + 1) * quota
    # 2 groups with signal left (finished, waiting), the rest dropped: the freed slots refill
    more = refill(quota, signal=2, held=2, target=target, rounds_played=0, max_rounds=4)
    assert more == 4 and 2 + more == target
    for held in range(target + 1):   # never past (k + 1) x quota
        assert held + refill(quota, min(held, quota - 1), held, target, 0, 4) <= max(held, target)
    # split placement sampling one version behind at k = 1: one batch's worth at most
    assert refill(quota, 0, 0, (k - 1 + 1) * quota, 0, 4) == quota


def test_refill_refuses_negative_counts():
    with pytest.raises(ValueError, match="negative"):
        refill(2, -1, 0, 2, 0, 4)


def test_extra_groups_never_share_a_key_or_seed_in_their_iteration():
    span, replicas, rounds = 6, 3, 4
    seen = set(range(span))   # round 0's admission
    for rnd in range(1, rounds + 1):
        for d in range(replicas):
            for j in range(span):
                i = extra_group_index(rnd, d, replicas, span, j, ITERATION_STRIDE)
                assert i not in seen
                seen.add(i)
    assert max(seen) < ITERATION_STRIDE
    with pytest.raises(ValueError, match="dynamic_sampling_rounds"):
        extra_group_index(100, 7, 8, 64, 0, ITERATION_STRIDE)


def test_round_sample_seeds_meet_no_iteration_seed():
    iteration_seeds = {rollout_sample_seed(s, i) for s in (0, 899) for i in (0, 8999)}
    assert round_sample_seed(5, 0) == 5
    for s in iteration_seeds:
        for rnd in range(1, 5):
            assert round_sample_seed(s, rnd) > max(iteration_seeds)
    assert len({round_sample_seed(s, r) for s in range(50) for r in range(5)}) == 250


@dataclass
class _Ep:
    reward: float


@dataclass
class _Entry:
    key: tuple
    g: int
    episode: Optional[_Ep] = None

    @property
    def group(self):
        return (self.key[0], self.key[1] // self.g)


def test_drop_flat_drops_only_finished_groups_without_signal():
    e = [_Entry((0, 0), 2, _Ep(1.0)), _Entry((0, 1), 2, _Ep(1.0)),     # flat: drops
         _Entry((0, 2), 2, _Ep(1.0)), _Entry((0, 3), 2, _Ep(0.0)),     # signal: stays
         _Entry((0, 4), 2, _Ep(0.0)), _Entry((0, 5), 2, None),         # live: stays
         _Entry((1, 0), 2, _Ep(0.5)), _Entry((1, 1), 2, _Ep(0.5))]     # flat: drops
    kept, gone = drop_flat(e)
    assert gone == 2
    assert [x.key for x in kept] == [(0, 2), (0, 3), (0, 4), (0, 5)]
    # a member that play_turns just finished counts before it is kept
    assert group_rewards(e[4:6], [((0, 5), _Ep(0.0))])[(0, 2)] == [0.0, 0.0]


def test_counts_add_up_or_refuse():
    c = DynamicCounts.summed([[5, 3, 2, 0, 2], [4, 1, 2, 1, 1]])
    assert (c.played, c.dropped, c.trained, c.carried, c.rounds) == (9, 4, 4, 1, 2)
    assert c.metrics()["dynamic_groups_played"] == 9
    with pytest.raises(ValueError, match="do not add up"):
        DynamicCounts(played=3, dropped=1, trained=1, carried=0)
