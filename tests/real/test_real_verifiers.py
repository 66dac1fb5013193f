"""verifiers environments train on the real model (issue #48 item 1): ONE ``earl train
env=verifiers`` run on SmolLM2-135M-Instruct (2 CPU ranks, the rollout in DP2: each replica's
leader loads the environment and serves its endpoint), 2 iterations of 6 episodes, of
verifiers' EnvGroup of the three kinds (earl_megatron/testing/vf_envs/all_kinds.py, one
question each, so consecutive episode seeds cycle through them and each replica plays every
kind every iteration):

    single_turn   SingleTurnEnv, a weighted Rubric
    multi_turn    MultiTurnEnv whose env_response asks again
    tool          ToolEnv with one Python tool, ``add``

One run instead of three: the same three environments, routed and scored by verifiers itself
(tests/unit/test_verifiers_glue.py checks that the group's rewards are each kind's alone), at a
third of the launches' cost on CI.

Asserted from the run's samples/ (rank 0's replica's episodes) and metrics.jsonl, per episode:
it played one of the environment's dataset rows; its reward is what the environment's own
rubric gives the messages the endpoint recorded (``rescore``, in this process); the multi-turn
and tool kinds called the endpoint as their environments drive it; and every row is
token-in/token-out: its decoded text is SmolLM2's chat template of its own messages (and the
tool's schema) up to the end of the row. Rewards, turns and replies per kind are printed with
``record``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = "earl_megatron.testing.vf_envs.all_kinds"
EPISODES = 6


@pytest.mark.timeout(1800)
def test_verifiers_envs_train_on_smollm2(smollm2_dir, scratch_dir, record):
    from transformers import AutoTokenizer

    from earl_megatron.agents.chat import ChatRenderer
    from earl_megatron.agents.verifiers_glue import verifiers_program
    from earl_megatron.testing.vf_envs import rescore

    out = scratch_dir / "vf"
    args = [f"run.init={smollm2_dir}", "env=verifiers", f"env.kwargs.id={ENV}",
            "env.kwargs.args={questions: 1}",
            "layout=static", "layout.rollout=dp2", "layout.logprob=dp2", "layout.train=dp2",
            "layout.memory_budget_gb=4",
            f"rollout.episodes_per_iteration={EPISODES}", "rollout.max_turns=3",
            "rollout.max_action_tokens=24", "rollout.temperature=0.7",
            "rollout.agent_timeout_s=900", "algorithm.micro_batch_tokens=1024",
            "algorithm.lr=2e-5",   # the SmolLM2 recipes' (the tiny default would wreck it)
            "run.iterations=2", "run.checkpoint_every=0", "run.eval_every=0",
            "run.eval_episodes=1", "run.live_view=false", "run.samples_per_iteration=1000",
            f"run.output_dir={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("EARL_STOP_FILE", None)
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "train",
                           "--nproc-per-node", "2", *args], env=env, capture_output=True,
                          text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]

    program = verifiers_program(ENV, {"questions": 1})
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(smollm2_dir)))
    seen: dict[str, list] = {}
    for it, record_ in enumerate(records):
        m = record_.get("metrics", record_)
        assert m["agent_errors"] == 0 and m["agent_timeouts"] == 0, m
        rows = [json.loads(line) for line in
                (out / "samples" / f"iter_{it:06d}.jsonl").read_text().splitlines()]
        firsts = [r for r in rows if "task" in r["info"]]
        kinds = sorted(r["info"]["task"]["info"]["env_id"] for r in firsts)
        assert kinds == ["multi_turn", "single_turn", "tool"], kinds   # rank 0's half
        for r in firsts:
            task, kind = r["info"]["task"], r["info"]["task"]["info"]["env_id"]
            assert task in program.tasks, task
            assert rescore(program.env, task, r["info"]["messages"]) == r["reward"], r
            said = [x for x in r["info"]["messages"] if x["role"] == "assistant"]
            # single-turn: one call; multi-turn: asked again (two, unless the first ends it)
            assert (len(said) == 1) if kind == "single_turn" else (1 <= len(said) <= 3), said
            if kind == "tool":   # the endpoint was offered the environment's tool
                assert r["info"]["tools"][0]["function"]["name"] == "add", r["info"]["tools"]
            seen.setdefault(kind, []).append((r["reward"], len(said),
                                              said[-1]["content"][:40] if said else None))
        for r in rows:   # token-in/token-out
            want = renderer.messages_text(r["info"]["messages"], r["info"].get("tools"), False)
            assert r["text"] and want.startswith(r["text"]), (r["text"][-300:], want[-300:])
    for kind, episodes in sorted(seen.items()):
        record(f"verifiers {kind} on SmolLM2: (reward, assistant turns, last reply) of rank 0's "
               "episodes", episodes)
