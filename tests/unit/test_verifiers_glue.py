"""env=verifiers in one process: each kind of verifiers environment (earl_megatron/testing/vf_envs:
single-turn, multi-turn, tool) played by the trainer's own AgentPlayer (the real endpoint,
broker and replica driver) through verifiers' ``run_rollout`` and its OpenAI client.

The policy is written out (``Scripted``: an engine whose reply is a function of the prompt it
is given, the tokens the endpoint then records), so that tool calls fire and each rubric meets
right and wrong answers: the reward of every episode equals its rubric's score recomputed here
from the messages the endpoint recorded (``rescore``) and the value worked out by hand; every
trained row is the endpoint's own token ids. The tiny model plays the tool env end to end
through ``earl train`` in tests/agents/test_agent_verifiers.py."""

import re

import pytest

from earl_megatron.agents.broker import ReplicaDriver
from earl_megatron.agents.programs import AgentConfigError
from earl_megatron.agents.server import ServerLimits
from earl_megatron.config.train import ConfigError
from earl_megatron.rollout.engine import Generation
from earl_megatron.rollout.tokenizer import char_tokenizer
from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.trainer.agent_rollout import AgentPlayer, AgentSpec, outcome_rows
from earl_megatron.train import validate

pytest.importorskip("verifiers")


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """verifiers' Environment installs SIGINT/SIGTERM handlers when it is built; the glue puts
    the trainer's back, and a test that builds one itself must not leave them to the next test
    of its process (pytest-xdist runs files in any order)."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)

TOK = char_tokenizer()
LIMITS = ServerLimits(max_context_tokens=4096, max_action_tokens=96, max_turns=3)
ENVS = "earl_megatron.testing.vf_envs."
CALL = '<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


class Scripted:
    """The policy as a function of its context: the sum asked last ("4+4" answered 88), with
    the ``add`` tool called first when it is offered, and "1+6" changed on a second ask."""

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = TOK.decode(p, skip_special_tokens=False)
            a, b = map(int, re.findall(r"What is (\d)\+(\d)\?", text)[-1])
            answer = str(a + b) if (a, b) != (4, 4) else "88"
            if '"name": "add"' in text and "<tool_call>" not in text.split("What is")[-1]:
                reply = CALL.format(a=a, b=b)
            elif "Are you sure" in text and (a, b) == (1, 6):
                reply = "8"
            else:
                reply = answer
            ids = TOK(reply, add_special_tokens=False)["input_ids"] + [params.stop_token_ids[0]]
            out.append(Generation(tuple(ids), (0.0,) * len(ids), "stop"))
        return out


def _play(kind: str, evaluation: bool = False):
    spec = AgentSpec.from_env_kwargs({"id": ENVS + kind, "args": {}}, concurrency=4,
                                     timeout_s=600.0, host="127.0.0.1", port=0)
    player = AgentPlayer(spec, TOK, LIMITS)
    try:
        seeds = list(range(len(player.eval_tasks if evaluation else player.tasks)))
        outcomes = player.play(ReplicaDriver(Scripted()), seeds, 0, LIMITS, evaluation)
    finally:
        player.close()
    return player, seeds, outcomes


# rewards by hand, per question 2+3, 4+4 (answered 88), 1+6, 3+6
@pytest.mark.parametrize("kind,rewards,calls", [
    ("single_turn", [1.5, 0.5, 1.5, 1.5], 1),      # correct 1 + brief 0.5
    ("multi_turn", [1.25, 0.25, 0.0, 1.25], 2),    # correct 1 + kept 0.25 ("1+6": 7 then 8)
    ("tool", [1.5, 0.5, 1.5, 1.5], 2),             # correct 1 + used_add 0.5
])
def test_rewards_are_the_rubric_scores_of_the_recorded_conversations(kind, rewards, calls):
    from earl_megatron.testing.vf_envs import rescore

    player, seeds, outcomes = _play(kind)
    env = player.agent.__self__.env
    assert [o.reward for o in outcomes] == rewards
    for seed, o in zip(seeds, outcomes):
        ep = o.episode
        assert not o.lost and ep.calls == calls and ep.task == player.task(seed)
        assert rescore(env, ep.task, ep.last_messages) == o.reward
        assert o.info["vf_stop"] and set(o.info["vf_metrics"]) >= {"correct"}
        if kind == "tool":   # the call fired: the tool's result is in the conversation
            a, b = map(int, re.findall(r"(\d)\+(\d)", ep.task["question"])[0])
            assert ep.tool_calls == 1 and ep.last_messages[-2]["role"] == "tool"
            assert ep.last_messages[-2]["content"] == str(a + b)
        # trained rows: the endpoint's token ids, each sampled run what the policy wrote there
        rows = outcome_rows(o, seed, TOK)
        assert [r.token_ids for r in rows] == [tuple(r.token_ids) for r in ep.tokens.rows()]
        assert all(r.reward == o.reward for r in rows)
        for r in rows:
            m = r.loss_mask
            for k in (k for k in range(len(m)) if m[k] and not m[k - 1]):
                wrote = Scripted().generate([r.token_ids[:k]], _Params)[0].token_ids
                assert r.token_ids[k:k + len(wrote)] == wrote and sum(m[k:k + len(wrote)]) \
                    == len(wrote)


def test_an_env_group_plays_each_kind_with_its_own_rubric():
    """verifiers' EnvGroup of the three (vf_envs/all_kinds.py): each row is played by its own
    environment and scored by its rubric, the same rewards as each kind alone."""
    from earl_megatron.testing.vf_envs import rescore

    player, seeds, outcomes = _play("all_kinds")
    env = player.agent.__self__.env
    assert [o.reward for o in outcomes] == [1.5, 0.5, 1.5, 1.5, 1.25, 0.25, 0.0, 1.25,
                                            1.5, 0.5, 1.5, 1.5]
    assert [o.episode.calls for o in outcomes] == [1] * 4 + [2] * 8
    assert [o.episode.task["info"]["env_id"] for o in outcomes] == \
        ["single_turn"] * 4 + ["multi_turn"] * 4 + ["tool"] * 4
    for o in outcomes:
        assert rescore(env, o.episode.task, o.episode.last_messages) == o.reward


class _Params:
    stop_token_ids = (TOK.convert_tokens_to_ids("<|end|>"),)


def test_an_evaluation_plays_the_eval_dataset():
    player, seeds, outcomes = _play("single_turn", evaluation=True)
    assert [o.episode.task["question"] for o in outcomes] == ["What is 5+2?", "What is 0+1?"]
    assert [o.reward for o in outcomes] == [1.5, 1.5]


@pytest.mark.parametrize("kwargs,match", [
    ({"id": None, "args": None}, "needs env.kwargs.id=MODULE"),   # env=verifiers alone
    ({"id": "no_such_vf_env_q"}, "cannot import module 'no_such_vf_env_q'.*PYTHONPATH"),
    ({"id": "json"}, "has no load_environment"),
    ({"id": ENVS + "tool", "args": {"nope": 1}}, "raised TypeError.*env.kwargs.args"),
    ({"id": ENVS + "tool", "args": {"max_turns": 9}}, "up to 9 turns.*rollout.max_turns=9"),
    ({"id": ENVS + "tool", "tasks": "t.jsonl"}, "reads id and args only"),
])
def test_bad_verifiers_input_is_one_line_before_any_rank(tmp_path, kwargs, match):
    cfg = tiny_connect_four(str(tmp_path), env={"name": "agent", "kwargs": kwargs,
                                                "eval_opponents": []})
    with pytest.raises(ConfigError, match=match) as e:
        validate(cfg, 2)
    assert "\n" not in str(e.value)
    validate(tiny_connect_four(str(tmp_path), env={
        "name": "agent", "kwargs": {"id": ENVS + "tool"}, "eval_opponents": []}), 2)


def test_an_environment_without_a_training_dataset_names_the_fix():
    import verifiers as vf

    from earl_megatron.agents import verifiers_glue
    from earl_megatron.testing.vf_envs import dataset

    env = vf.SingleTurnEnv(eval_dataset=dataset())
    verifiers_glue._CACHE[("eval_only", "{}")] = env
    with pytest.raises(AgentConfigError, match="no training dataset.*dataset="):
        verifiers_glue.verifiers_program("eval_only", {})
