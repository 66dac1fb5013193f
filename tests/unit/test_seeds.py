"""earl_megatron/seeds.py: the environment-seed streams of a run never meet (RL iterations among
themselves, RL, evaluation, the warm start's expert), over the whole documented domain, checked
as intervals rather than by sampling; and each stream is the formula the trainer has always
used (a resumed or repeated run draws the same seeds)."""

import itertools

import pytest

from earl_megatron import seeds as S


def _intervals(run_seed):
    """[lo, hi) of every stream of one run at the domain's limits."""
    rl = [(S.episode_seeds(run_seed, i, 1)[0], S.episode_seeds(run_seed, i, 1)[0]
           + S.ITERATION_STRIDE) for i in (0, S.MAX_ITERATIONS - 1)]
    ev = S.evaluation_seeds(run_seed, 1)[0]
    ex = S.expert_seeds(run_seed, 1)[0]
    return {"rl": (rl[0][0], rl[1][1]), "eval": (ev, ev + S.EVAL_STRIDE),
            "expert": (ex, ex + S.EVAL_STRIDE)}


@pytest.mark.parametrize("run_seed", [0, 1, 17, S.MAX_RUN_SEED - 1])
def test_streams_of_a_run_are_disjoint(run_seed):
    spans = _intervals(run_seed)
    for (a, (lo1, hi1)), (b, (lo2, hi2)) in itertools.combinations(spans.items(), 2):
        assert hi1 <= lo2 or hi2 <= lo1, (run_seed, a, b, spans)


def test_iterations_never_share_a_seed_and_groups_do():
    a = S.episode_seeds(3, 5, S.ITERATION_STRIDE)
    b = S.episode_seeds(3, 6, S.ITERATION_STRIDE)
    assert len(set(a)) == S.ITERATION_STRIDE and not set(a) & set(b)
    assert S.episode_seeds(0, 2, 6, group_size=3) == [20014, 20014, 20014, 20015, 20015, 20015]


def test_the_formulas_the_trainer_has_used():
    # changing one changes every run's games and samples: these values pin them
    assert S.episode_seeds(2, 3, 2) == [2 * 1_000_003 + 3 * 10_007, 2 * 1_000_003 + 3 * 10_007 + 1]
    assert S.evaluation_seeds(2, 2) == [10**9 + 200_006, 10**9 + 200_007]
    assert S.expert_seeds(2, 1) == [3 * 10**9 + 200_006]
    assert S.rollout_sample_seed(2, 3) == 2 * 7919 + 3
    assert S.turn_sample_seed(5, 4) == 5 * 1_000_003 + 4
    assert S.row_sample_seed(2**62, 7) == (2**62 * 1_000_003 + 7) % (2**63 - 1)
    assert S.EVAL_SAMPLE_SEED == 424242
