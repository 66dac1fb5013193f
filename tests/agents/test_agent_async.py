"""Agent programs under asynchronous RL (env.name=agent, algorithm.max_staleness=1,
trainer/agent_pool.py), as a user runs it (``earl train``, 2 ranks, the rollout replica tp2: its
leader serves the endpoint, its other rank decodes every batch beside it).

The tasks alternate ``plain`` (one call) and ``span`` (one call, then a second once iteration
0's samples are written: earl_megatron/testing/agents.py). Episode seeds of iteration 0 are
consecutive, so its 8 admitted episodes ((k + 1) batches of 4) are 4 of each: the stage ends once
the 4 plain ones finish, the 4 ``span`` programs keep running through iteration 0's TRAIN step,
their second calls wait in the broker and are decoded by iteration 1's stage with version 1.

Checked from the records and samples: staleness_max <= k every iteration and 1 in iteration 1
(whose batch is the spanning episodes: the oldest finished groups train first), some trained row
holds turns of versions 0 and 1, no group dropped or lost, and every episode (its pool key:
iteration started, index) trained at most once, 4 per iteration."""

from agent_runs import N, run_agents_k1, trained_once


def test_agent_episodes_live_across_iterations_within_the_staleness_bound(tmp_path):
    ms = run_agents_k1(tmp_path, 2, ["layout=static", "layout.rollout=tp2", "layout.train=dp2",
                                     "layout.logprob=dp2"])
    for m in ms:
        assert m["rollout_logprob_diff_max"] < 1e-4, m   # the rows' logprobs are the engine's
    assert [m["pool_admitted"] for m in ms] == [2 * N, N, N]
    assert [m["pool_carried"] for m in ms] == [0, N, N]
    assert ms[0]["staleness_max"] == 0 and ms[1]["staleness_max"] == 1

    by_it = trained_once(tmp_path)
    # (iteration trained, task kind) of rows with turns of two versions
    spanned = [(it, r["info"].get("task", {}).get("kind")) for it, rows in enumerate(by_it)
               for r in rows if len(set(r["turn_versions"])) == 2]
    trained = [tuple(r["info"]["pool_key"]) for rows in by_it for r in rows
               if "pool_key" in r["info"]]
    # iteration 0 trains its plain episodes; iteration 1 the span ones started in iteration 0,
    # each with a turn of version 0 and one of version 1 (iteration 1's own span episodes may
    # span too, as the machine's timing has it: whether their second call beat the stage's end)
    assert [k for it, k in spanned if it == 1] == ["span"] * N, spanned
    assert {k for _, k in spanned} == {"span"}, spanned
    assert sorted(k for k in trained[N:2 * N]) == [(0, 1), (0, 3), (0, 5), (0, 7)], trained
