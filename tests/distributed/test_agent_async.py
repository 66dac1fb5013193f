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

import json
import os
import subprocess
import sys

N = 4


def test_agent_episodes_live_across_iterations_within_the_staleness_bound(tmp_path):
    out = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    span_after = out / "samples" / "iter_000000.jsonl"
    tasks.write_text("".join(json.dumps({"kind": k, "prompt": "say hi",
                                         "span_after": str(span_after)}) + "\n"
                             for k in ("plain", "span")))
    args = ["model.vocab_size=128", "rollout.tokenizer=ascii", "env=agent",
            "env.kwargs.entry=earl_megatron.testing.agents:probe", f"env.kwargs.tasks={tasks}",
            "layout=static", "layout.rollout=tp2", "layout.train=dp2", "layout.logprob=dp2",
            f"rollout.episodes_per_iteration={N}", "rollout.max_turns=3",
            "rollout.max_action_tokens=6", "rollout.max_context_tokens=256",
            "rollout.agent_timeout_s=600", "algorithm.micro_batch_size=2",
            "algorithm.old_logprobs=recompute", "algorithm.off_policy=decoupled",
            "algorithm.max_staleness=1", "run.iterations=3", "run.checkpoint_every=0",
            "run.eval_every=0", "run.eval_episodes=1", "run.live_view=false",
            "run.samples_per_iteration=100", f"run.output_dir={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("EARL_STOP_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "train",
                           "--nproc-per-node", "2", *args], env=env, capture_output=True,
                          text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    ms = [r.get("metrics", r) for r in records]
    for m in ms:
        assert m["staleness_max"] <= 1, m
        assert m["pool_dropped"] == 0 and m["agent_restarted"] == 0, m
        assert m["agent_errors"] == 0 and m["agent_timeouts"] == 0, m
        assert m["rollout_logprob_diff_max"] < 1e-4, m   # the rows' logprobs are the engine's
    assert [m["pool_admitted"] for m in ms] == [2 * N, N, N]
    assert [m["pool_carried"] for m in ms] == [0, N, N]
    assert ms[0]["staleness_max"] == 0 and ms[1]["staleness_max"] == 1

    trained: list = []
    spanned = []    # (iteration trained, task kind) of rows with turns of two versions
    for it in range(3):
        rows = [json.loads(line) for line in
                (out / "samples" / f"iter_{it:06d}.jsonl").read_text().splitlines()]
        firsts = [r for r in rows if "pool_key" in r["info"]]
        assert len(firsts) == N, rows
        trained += [tuple(r["info"]["pool_key"]) for r in firsts]
        for r in rows:
            versions = set(r["turn_versions"])
            assert versions <= {it - 1, it}, (it, r["turn_versions"])
            if len(versions) == 2:
                spanned.append((it, r["info"].get("task", {}).get("kind")))
    assert len(trained) == len(set(trained)) == 3 * N, trained     # each trained once
    # iteration 0 trains its plain episodes; iteration 1 the span ones started in iteration 0,
    # each with a turn of version 0 and one of version 1 (iteration 1's own span episodes may
    # span too, as the machine's timing has it: whether their second call beat the stage's end)
    assert [k for it, k in spanned if it == 1] == ["span"] * N, spanned
    assert {k for _, k in spanned} == {"span"}, spanned
    assert sorted(k for k in trained[N:2 * N]) == [(0, 1), (0, 3), (0, 5), (0, 7)], trained
