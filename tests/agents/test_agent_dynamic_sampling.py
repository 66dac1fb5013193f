"""DAPO's dynamic sampling with agent programs at k = 1 (env.name=agent, trainer/agent_pool.py),
as a user runs it (``earl train``, 2 ranks, rollout dp2: two replicas, each leader serving its
endpoint): GRPO groups of 2, the probe agent's ``parity`` task (reward 1 for an answer of even
length, so some groups' rewards are equal and some differ).

Checked from the records and the samples every replica wrote: the counts add up every
iteration (played = trained + dropped + carried), some group was dropped over the run, every
trained group is whole with rewards that differ, no trained token is more than k = 1 versions
old, and no episode (its pool key) trained twice."""

import json
import os
import subprocess
import sys
from collections import defaultdict

G, N = 2, 4


def test_agent_groups_without_signal_drop_and_more_programs_play(tmp_path):
    out = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"kind": "parity", "prompt": "say hi"}) + "\n")
    args = ["model.vocab_size=128", "rollout.tokenizer=ascii", "env=agent",
            "env.kwargs.entry=earl_megatron.testing.agents:probe", f"env.kwargs.tasks={tasks}",
            "layout=static", "layout.rollout=dp2", "layout.train=dp2", "layout.logprob=dp2",
            f"rollout.episodes_per_iteration={N}", "rollout.max_turns=2",
            "rollout.max_action_tokens=6", "rollout.max_context_tokens=256",
            "rollout.agent_timeout_s=600", "algorithm=grpo", f"algorithm.group_size={G}",
            "algorithm.micro_batch_size=2", "algorithm.max_staleness=1",
            "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_rounds=3",
            "run.iterations=3", "run.checkpoint_every=0", "run.eval_every=0",
            "run.eval_episodes=1", "run.live_view=false", "run.samples_per_iteration=100",
            f"run.output_dir={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("EARL_STOP_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "train",
                           "--nproc-per-node", "2", *args], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    dropped = 0
    for m in records:
        assert m["dynamic_groups_played"] == (m["dynamic_groups_trained"] +
                                              m["dynamic_groups_dropped"] +
                                              m["dynamic_groups_carried"]), m
        assert m["staleness_max"] <= 1 and m["agent_errors"] == 0, m
        dropped += m["dynamic_groups_dropped"]
    assert dropped > 0, records
    seen = set()
    for it, m in enumerate(records):
        if m.get("skipped"):
            continue
        rows = [json.loads(x) for x in
                (out / "samples" / f"iter_{it:06d}.jsonl").read_text().splitlines()]
        firsts = [r for r in rows if "pool_key" in r["info"]]
        by_group = defaultdict(list)
        for r in firsts:
            key = tuple(r["info"]["pool_key"])
            assert key not in seen, key            # trained once over the run
            seen.add(key)
            by_group[(key[0], key[1] // G)].append(r["reward"])
        # rank 0's replica wrote its block: its groups whole, each with signal
        assert by_group and all(len(v) == G and len(set(v)) > 1 for v in by_group.values()), \
            (it, dict(by_group))
