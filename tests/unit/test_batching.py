"""Length-grouped micro-batches (plan/batching.py): exactly-once, size, padding, balance."""

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from earl_megatron.plan.batching import micro_batch_cost, plan_micro_batches


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=80),
       dp=st.integers(1, 8), mbs=st.integers(1, 8), multiple=st.sampled_from([1, 2, 8]),
       max_tokens=st.one_of(st.none(), st.integers(1, 6000)))
def test_every_sample_once_with_its_micro_batch_length(lengths, dp, mbs, multiple, max_tokens):
    lens = dict(enumerate(lengths))
    if len(lens) < dp:
        with pytest.raises(ValueError, match="cannot feed dp"):
            plan_micro_batches(lens, dp, mbs, multiple, max_tokens)
        return
    plan = plan_micro_batches(lens, dp, mbs, multiple, max_tokens)
    padded = plan.length_of
    seen = [s for per_dp in plan.assignment for mb in per_dp for s in mb]
    assert sorted(seen) == sorted(lens)
    assert len(plan.assignment) == dp and all(plan.assignment)  # every dp rank trains
    # no dp rank runs more micro-batches than it must (the others are padded up to it)
    groups = sum(len(per_dp) for per_dp in plan.assignment)
    assert max(len(per_dp) for per_dp in plan.assignment) == -(-groups // dp)
    for per_dp in plan.assignment:
        for mb in per_dp:
            assert 1 <= len(mb) <= mbs
            if max_tokens is not None and len(mb) > 1:
                assert len(mb) * padded[mb[0]] <= max_tokens
            assert len({padded[s] for s in mb}) == 1
            assert padded[mb[0]] == -(-max(lens[s] for s in mb) // multiple) * multiple
    for s in lens:
        assert padded[s] >= lens[s] and padded[s] % multiple == 0
    assert plan == plan_micro_batches(dict(reversed(list(lens.items()))), dp, mbs, multiple,
                                      max_tokens)


def test_grouping_pads_far_less_than_the_longest_sample():
    # 60 short episodes and 4 long ones: one padded length for all would be ~8x the tokens
    lens = {i: 100 for i in range(60)} | {60 + i: 1000 for i in range(4)}
    plan = plan_micro_batches(lens, 4, 4, 8)
    assert plan.padded_tokens == 60 * 104 + 4 * 1000
    assert 64 * 1000 / plan.padded_tokens > 6
    # every dp rank runs 4 micro-batches (padding ones cost as much as real ones): the long one
    # shares its rank with the three shortest
    busiest = max(plan.assignment, key=lambda per_dp: plan.length_of[per_dp[0][0]])
    assert [plan.length_of[mb[0]] for mb in busiest] == [1000, 104, 104, 104]
    assert micro_batch_cost(4, 1000) > 3 * micro_batch_cost(4, 104)


def test_token_budget_trains_long_samples_alone():
    lens = {0: 1000, 1: 900, 2: 300, 3: 290, 4: 280, 5: 100}
    plan = plan_micro_batches(lens, 1, 4, 8, max_tokens=1024)
    assert sorted(plan.assignment[0]) == sorted(((0,), (1,), (2, 3, 4), (5,)))
    assert plan.length_of[0] == 1000 and plan.length_of[1] == 904 and plan.length_of[4] == 304


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_micro_batches({0: 5}, 0, 4)
