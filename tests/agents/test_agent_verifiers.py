"""env=verifiers end to end, as a user runs it: ``earl train env=verifiers env.kwargs.id=...``
on the tiny model, 2 ranks (rollout tp2: the replica's leader loads the environment and serves
the endpoint, its other rank decodes beside it), 2 iterations, a start and end evaluation. The environment is the
ToolEnv of earl_megatron/testing/vf_envs/tool.py (one Python tool); the other kinds, and tool
calls that fire, are covered in one process by tests/unit/test_verifiers_glue.py.

Checked from the run's records: every episode of every iteration played one of the
environment's dataset rows, its reward equals the environment's rubric rescoring the messages
the endpoint recorded for it (``rescore``, here, in this process), the reward metric is their
mean, and every trained row is token-in/token-out: its text is the chat template's rendering
of its own messages (with the tool's schema) up to the end of the row."""

import json

import pytest

from agent_runs import earl_train

pytest.importorskip("verifiers")

ENV = "earl_megatron.testing.vf_envs.tool"
N = 4


def test_a_verifiers_tool_env_trains_on_the_endpoints_tokens_and_its_rubric(tmp_path):
    from earl_megatron.agents.chat import ChatRenderer
    from earl_megatron.agents.verifiers_glue import verifiers_program
    from earl_megatron.config.train import TrainConfig
    from earl_megatron.testing.vf_envs import rescore
    from earl_megatron.train import make_tokenizer

    out = tmp_path / "run"
    args = ["model.vocab_size=128", "rollout.tokenizer=ascii", "env=verifiers",
            f"env.kwargs.id={ENV}", "env.kwargs.args={max_turns: 2}", "layout=static",
            "layout.rollout=tp2", "layout.train=dp2", "layout.logprob=dp2",
            f"rollout.episodes_per_iteration={N}", "rollout.max_turns=2",
            "rollout.max_action_tokens=8", "rollout.max_context_tokens=2048",
            "rollout.agent_timeout_s=600", "algorithm.micro_batch_size=2",
            "run.iterations=2", "run.checkpoint_every=0", "run.eval_every=0",
            "run.eval_episodes=2", "run.live_view=false", "run.samples_per_iteration=100"]
    records = earl_train(out, [*args, f"run.output_dir={out}"])
    assert [r["iteration"] for r in records] == [0, 1]

    program = verifiers_program(ENV, {"max_turns": 2})
    cfg = TrainConfig.from_dict(json.loads((out / "resolved.json").read_text()))
    renderer = ChatRenderer(make_tokenizer(cfg))
    for it, record in enumerate(records):
        m = record.get("metrics", record)
        assert m["agent_errors"] == 0 and m["agent_timeouts"] == 0, m
        rows = [json.loads(line) for line in
                (out / "samples" / f"iter_{it:06d}.jsonl").read_text().splitlines()]
        firsts = [r for r in rows if "task" in r["info"]]
        assert len(firsts) == N
        for r in firsts:
            task = r["info"]["task"]
            assert task in program.tasks
            assert rescore(program.env, task, r["info"]["messages"]) == r["reward"], r
            assert set(r["info"]["vf_metrics"]) >= {"correct", "used_add"}
        assert m["agent_reward_mean"] == pytest.approx(sum(r["reward"] for r in firsts) / N)
        for r in rows:   # token-in/token-out: the row is its messages' template text
            want = renderer.messages_text(r["info"]["messages"], r["info"]["tools"], False)
            assert want.startswith(r["text"]), (r["text"], want)
            assert r["info"]["tools"][0]["function"]["name"] == "add"
