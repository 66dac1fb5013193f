"""Agent programs on a split (env.name=agent, rollout.placement=split, k = 1), as a user runs it
(``earl train``, 3 ranks): the train pool, ranks 0-1 in tp2 (one replica: rank 0 writes every
sample of the batch), trains batch j - 1 while the rollout pool, rank 2, serves the agents'
endpoint and plays stage j; the programs' calls are decoded by the rollout pool under the
weights the last handoff brought.

The tasks alternate ``plain`` (one call) and ``span`` (a second call once iteration 0's samples
exist, earl_megatron/testing/agents.py), so some episodes outlive a stage. Checked from the
records and samples: three iterations trained, every one with a split record; staleness_max <=
k; no group dropped, restarted or lost; every episode (its pool key) trained at most once, N per
iteration; every trained row's turns were sampled by the versions a split can hold (the
iteration's or the one before)."""

from agent_runs import run_agents_k1, trained_once


def test_agent_programs_on_a_split_train_every_episode_once_within_the_bound(tmp_path):
    ms = run_agents_k1(tmp_path, 3, [
        "layout=static", "layout.rollout=dp1", "layout.train=tp2", "layout.logprob=tp2",
        "rollout.placement=split", "rollout.pool_ranks=1", "algorithm.name=grpo",
        "algorithm.group_size=2"])
    for m in ms:
        assert m["split"]["rollout_ranks"] == 1, m
    trained_once(tmp_path)
