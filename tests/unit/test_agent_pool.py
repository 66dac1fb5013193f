"""trainer/agent_pool.py's checkpoint rule: a running agent program cannot be saved, so the
checkpoint lists groups as (key, seed) and a restored pool restarts every one of them."""

import pytest

from earl_megatron.rollout.agent_loop import AgentLoopConfig
from earl_megatron.trainer.agent_pool import AgentPool


def _pool() -> AgentPool:
    return AgentPool("agent", {}, None, AgentLoopConfig(temperature=0.5), batch=4,
                     group_size=2, max_staleness=1, run_seed=0)


def test_restored_groups_restart_from_their_seeds_and_save_as_they_came():
    saved = {"layout": "tp2", "agents": True,
             "entries": [{"key": [0, 4], "seed": 2, "group_size": 2},
                         {"key": [0, 5], "seed": 2, "group_size": 2}]}
    pool = _pool()
    pool.restore(saved)
    assert [d["restart"] for d in pool._restored] == [True, True]
    assert [(d["key"], d["finished"], d["oldest"]) for d in pool._restored] == \
        [((0, 4), False, None), ((0, 5), False, None)]
    assert pool.state() == saved        # a checkpoint before the next stage saves the same
    assert pool.begin() == [] and pool.temperature == 0.5


def test_restoring_another_kind_of_pool_names_the_fix():
    with pytest.raises(ValueError, match="not an agent pool"):
        _pool().restore({"layout": None, "entries": []})


def test_sglang_pool_path_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="rollout.engine=embedded"):
        _pool().follow(None)
