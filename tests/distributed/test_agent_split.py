"""Agent programs on a split (env.name=agent, rollout.placement=split, k = 1), as a user runs it
(``earl train``, 3 ranks): the train pool, ranks 0-1 in tp2 (one replica: rank 0 writes every
sample of the batch), trains batch j - 1 while the
rollout pool, rank 2, serves the agents' endpoint and plays stage j; the programs' calls are
decoded by the rollout pool under the weights the last handoff brought.

The tasks alternate ``plain`` (one call) and ``span`` (a second call once iteration 0's samples
exist, earl_megatron/testing/agents.py), so some episodes outlive a stage. Checked from the
records and samples: three iterations trained, every one with a split record; staleness_max <=
k; no group dropped, restarted or lost; every episode (its pool key) trained at most once, N per
iteration; every trained row's turns were sampled by the versions a split can hold (the
iteration's or the one before)."""

import json
import os
import subprocess
import sys

N = 4


def test_agent_programs_on_a_split_train_every_episode_once_within_the_bound(tmp_path):
    out = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    span_after = out / "samples" / "iter_000000.jsonl"
    tasks.write_text("".join(json.dumps({"kind": k, "prompt": "say hi",
                                         "span_after": str(span_after)}) + "\n"
                             for k in ("plain", "span")))
    args = ["model.vocab_size=128", "rollout.tokenizer=ascii", "env=agent",
            "env.kwargs.entry=earl_megatron.testing.agents:probe", f"env.kwargs.tasks={tasks}",
            "layout=static", "layout.rollout=dp1", "layout.train=tp2", "layout.logprob=tp2",
            "rollout.placement=split", "rollout.pool_ranks=1",
            f"rollout.episodes_per_iteration={N}", "rollout.max_turns=3",
            "rollout.max_action_tokens=6", "rollout.max_context_tokens=256",
            "rollout.agent_timeout_s=600", "algorithm.micro_batch_size=2",
            "algorithm.name=grpo", "algorithm.group_size=2",
            "algorithm.old_logprobs=recompute", "algorithm.off_policy=decoupled",
            "algorithm.max_staleness=1", "run.iterations=3", "run.checkpoint_every=0",
            "run.eval_every=0", "run.eval_episodes=1", "run.live_view=false",
            "run.samples_per_iteration=100", f"run.output_dir={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("EARL_STOP_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "train",
                           "--nproc-per-node", "3", *args], env=env, capture_output=True,
                          text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    ms = [r.get("metrics", r) for r in records]
    for m in ms:
        assert m["split"]["rollout_ranks"] == 1, m
        assert m["staleness_max"] <= 1, m
        assert m["pool_dropped"] == 0 and m["agent_restarted"] == 0, m
        assert m["agent_errors"] == 0 and m["agent_timeouts"] == 0, m

    trained: list = []
    for it in range(3):
        rows = [json.loads(line) for line in
                (out / "samples" / f"iter_{it:06d}.jsonl").read_text().splitlines()]
        firsts = [r for r in rows if "pool_key" in r["info"]]
        assert len(firsts) == N, rows
        trained += [tuple(r["info"]["pool_key"]) for r in firsts]
        for r in rows:
            assert set(r["turn_versions"]) <= {it - 1, it}, (it, r["turn_versions"])
    assert len(trained) == len(set(trained)) == 3 * N, trained     # each trained once
