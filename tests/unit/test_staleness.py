"""Asynchronous RL's rules (plan/staleness.py): admission, the bound, placement, the pick, and
the staleness record; a pool simulation checks that no trained token is ever older than k."""

import random

import pytest

from earl_megatron.plan.staleness import (GroupState, admissible, assign_groups, must_finish,
                                          pick_trained, replica_quotas, staleness, token_ages,
                                          too_stale)


def test_k0_admits_one_batch_into_an_empty_pool_and_nothing_more():
    assert admissible(0, 8, 1, held=0) == 8
    assert admissible(0, 8, 2, held=0) == 4          # whole groups of 2
    assert admissible(0, 8, 1, held=8) == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_admission_fills_to_k_plus_one_batches(k):
    assert admissible(k, 8, 1, held=0) == (k + 1) * 8
    assert admissible(k, 8, 2, held=5) == ((k + 1) * 8 - 5) // 2   # never past the cap
    assert admissible(k, 8, 1, held=(k + 1) * 8 + 3) == 0


def test_admission_refuses_a_batch_of_partial_groups():
    with pytest.raises(ValueError, match="not whole groups"):
        admissible(1, 6, 4, held=0)


def test_the_bound():
    assert not too_stale(None, 10, 0)                # nothing sampled yet
    assert not too_stale(5, 5, 0) and too_stale(4, 5, 0)
    assert not too_stale(3, 5, 2) and too_stale(2, 5, 2)
    # a group that could not continue into the next stage must finish in this one
    assert must_finish(4, 5, 1) and not must_finish(5, 5, 1) and not must_finish(None, 5, 1)
    assert must_finish(3, 5, 2) and not must_finish(4, 5, 2)


def test_replica_quotas_split_like_split_evenly():
    assert replica_quotas(5, 2) == [3, 2]
    assert replica_quotas(4, 4) == [1, 1, 1, 1]
    assert sum(replica_quotas(7, 3)) == 7


def _g(key, oldest=None, finished=False, replica=None, size=1):
    return GroupState(key, size, oldest, finished, replica)


def test_groups_stay_on_their_replica_while_the_layout_stays():
    carried = [_g((0, 0), 0, replica=1), _g((0, 1), 0, replica=1)]
    where, placed = assign_groups(carried, 4, [2, 2], 1, same_layout=True)
    assert where == {(0, 0): 1, (0, 1): 1}
    # replica 0 has 4 free of its target (k + 1) * 2, replica 1 has 2: new ones even that out
    assert sorted(placed) == [0, 0, 0, 1]


def test_after_a_layout_change_carried_groups_are_dealt_oldest_first():
    carried = [_g((1, 0), 1, replica=0), _g((0, 3), 0, replica=0), _g((1, 1), None, replica=0)]
    where, placed = assign_groups(carried, 1, [1, 1], 1, same_layout=False)
    assert where[(0, 3)] == 0 and where[(1, 0)] == 1 and where[(1, 1)] == 0
    assert placed == [1]


def test_pick_trains_the_oldest_finished_groups_first():
    done = [_g((2, 0), 2, True), _g((1, 4), 1, True), _g((1, 2), 1, True), _g((2, 1), 2, True)]
    assert pick_trained(done, 2) == [(1, 2), (1, 4)]
    assert pick_trained(done, 9) == [(1, 2), (1, 4), (2, 0), (2, 1)]


def test_staleness_record():
    ages = {}
    for versions, mask in (((-1, 3, 3, -1, 4), (0, 1, 1, 0, 1)), ((-1, 4), (0, 1))):
        for a, n in token_ages(versions, mask, 4).items():
            ages[a] = ages.get(a, 0) + n
    st = staleness(ages, 4)
    assert ages == {1: 2, 0: 2} and st.mean == 0.5 and st.max == 1
    assert st.shares == {0: 0.5, 1: 0.5}
    assert token_ages((), (0, 1, 1), 7) == {0: 2}       # an agent's row: its own version
    assert staleness({}, 0).mean == 0.0


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("dp_per_iteration", [[2, 2, 2, 2, 2, 2], [1, 2, 4, 2, 1, 4]])
def test_a_simulated_pool_never_trains_a_token_older_than_k(k, dp_per_iteration):
    """Episodes of random lengths (in turns) under the rules: admit, drop, place, play one turn
    at a time until each replica has its quota and no live group must finish, pick. Every
    trained token's age <= k, every stage ends, the pool never holds more than (k + 1) batches,
    and nothing is dropped: a long episode is waited for, never lost for being long."""
    rng = random.Random(k * 100 + len(dp_per_iteration))
    batch, g = 8, 2
    pool = {}        # group key -> dict(turns_left, versions, replica)
    trained_ages, started, dropped = [], 0, 0
    prev_dp = None
    for it, dp in enumerate(dp_per_iteration):
        states = []
        for key, grp in list(pool.items()):
            oldest = min(grp["versions"]) if grp["versions"] else None
            if too_stale(oldest, it, k):
                del pool[key]
                dropped += 1
                continue
            states.append(GroupState(key, g, oldest, grp["left"] == 0, grp["replica"]))
        held = sum(s.size for s in states)
        new = admissible(k, batch, g, held)
        assert held + new * g <= (k + 1) * batch
        quotas = replica_quotas(batch // g, dp)
        where, placed = assign_groups(states, new, quotas, k, same_layout=dp == prev_dp)
        for key, r in where.items():
            pool[key]["replica"] = r
        for j, r in enumerate(placed):
            pool[(it, j)] = {"left": rng.choice([1, 1, 2, 3, 6]), "versions": [],
                             "replica": r}
            started += 1
        for r in range(dp):
            mine = [key for key, grp in pool.items() if grp["replica"] == r]
            assert len(mine) >= quotas[r], "a replica cannot fill its quota"
            def oldest(key):
                return min(pool[key]["versions"]) if pool[key]["versions"] else None

            while sum(pool[key]["left"] == 0 for key in mine) < quotas[r] or any(
                    pool[key]["left"] and must_finish(oldest(key), it, k) for key in mine):
                for key in mine:
                    if pool[key]["left"]:
                        pool[key]["left"] -= 1
                        pool[key]["versions"].append(it)
            done = [GroupState(key, g, min(pool[key]["versions"]), True) for key in mine
                    if pool[key]["left"] == 0]
            for key in pick_trained(done, quotas[r]):
                trained_ages.extend(it - v for v in pool.pop(key)["versions"])
        prev_dp = dp
    assert trained_ages and max(trained_ages) <= k and dropped == 0
    if k:
        assert max(trained_ages) >= 1   # episodes did carry over


def test_admission_under_a_lag_keeps_every_admitted_group_trainable():
    # split placement: the rollout pool samples one version behind the step that trains
    assert admissible(1, 8, 1, held=0, lag=1) == 8          # k = lag: one batch
    assert admissible(2, 8, 2, held=0, lag=1) == 8          # two batches, in groups of 2
    assert admissible(1, 8, 1, held=0, lag=2) == 0          # past the bound: none
    assert admissible(3, 8, 1, held=5, lag=1) == 3 * 8 - 5
    with pytest.raises(ValueError, match="lag must be >= 0"):
        admissible(1, 8, 1, held=0, lag=-1)
