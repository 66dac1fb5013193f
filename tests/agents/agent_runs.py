"""Agent-program runs at k = 1 as a user starts them (``earl train``), shared by
tests/agents/test_agent_async.py (colocated) and test_agent_split.py (split placement).

The tasks alternate ``plain`` (one call) and ``span`` (one call, then a second once iteration
0's samples exist: earl_megatron/testing/agents.py), so some episodes outlive a stage."""

import json
import os
import subprocess
import sys

N = 4
"""Episodes per iteration."""


def earl_train(out, args: list[str], nproc: int = 2) -> list[dict]:
    """``earl train --nproc-per-node nproc *args`` (``run.output_dir`` is ``out``), which must
    exit 0: its metrics.jsonl records."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("EARL_STOP_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "train",
                           "--nproc-per-node", str(nproc), *args], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_agents_k1(tmp_path, nproc: int, layouts: list[str], *extra: str) -> list[dict]:
    """A 3-iteration run of the probe agent at k = 1 on ``nproc`` ranks with ``layouts``
    (Hydra overrides) and ``extra``; each iteration's metrics (the run must exit 0)."""
    out = tmp_path / "run"
    tasks = tmp_path / "tasks.jsonl"
    span_after = out / "samples" / "iter_000000.jsonl"
    tasks.write_text("".join(json.dumps({"kind": k, "prompt": "say hi",
                                         "span_after": str(span_after)}) + "\n"
                             for k in ("plain", "span")))
    args = ["model.vocab_size=128", "rollout.tokenizer=ascii", "env=agent",
            "env.kwargs.entry=earl_megatron.testing.agents:probe", f"env.kwargs.tasks={tasks}",
            *layouts, f"rollout.episodes_per_iteration={N}", "rollout.max_turns=3",
            "rollout.max_action_tokens=6", "rollout.max_context_tokens=256",
            "rollout.agent_timeout_s=600", "algorithm.micro_batch_size=2",
            "algorithm.max_staleness=1", "run.iterations=3", "run.checkpoint_every=0",
            "run.eval_every=0", "run.eval_episodes=1", "run.live_view=false",
            "run.samples_per_iteration=100", f"run.output_dir={out}", *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("EARL_STOP_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "train",
                           "--nproc-per-node", str(nproc), *args], env=env,
                          capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    ms = [r.get("metrics", r) for r in records]
    for m in ms:
        assert m["staleness_max"] <= 1, m
        assert m["pool_dropped"] == 0 and m["agent_restarted"] == 0, m
        assert m["agent_errors"] == 0 and m["agent_timeouts"] == 0, m
    return ms


def trained_once(tmp_path) -> list[list[dict]]:
    """Each iteration's rows as rank 0 wrote them (every sample of its replica), checked: N
    episodes (their first rows carry the pool key) an iteration, every episode trained once
    over the run, every turn sampled by the iteration's version or the one before."""
    trained, by_it = [], []
    for it in range(3):
        path = tmp_path / "run" / "samples" / f"iter_{it:06d}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        firsts = [r for r in rows if "pool_key" in r["info"]]
        assert len(firsts) == N, rows
        trained += [tuple(r["info"]["pool_key"]) for r in firsts]
        for r in rows:
            assert set(r["turn_versions"]) <= {it - 1, it}, (it, r["turn_versions"])
        by_it.append(rows)
    assert len(trained) == len(set(trained)) == 3 * N, trained     # each trained once
    return by_it
