"""examples/agents: the calculator agent a user writes, and the files its recipe reads.

The warm start teaches what the agent shows the model: on SmolLM2's tokenizer the endpoint's
text of a conversation as examples/agents/calculator_openai.py sends it (system CALCULATOR_TASK,
``tools=[CALCULATOR_SCHEMA]``, calls as ``tool_calls``, results as role "tool" messages) is the
text of the expert's warm-start trace of the same episode (examples/agents/make_tasks.py), the
system turn (json_system_prompt()) first of all. The example's entry resolves as
``env.kwargs.entry`` does from the repository root.
"""

from __future__ import annotations

import json

from earl_megatron.agents.chat import ChatRenderer
from earl_megatron.agents.programs import resolve
from earl_megatron.envs.tool_calls import (CALCULATOR_SCHEMA, CALCULATOR_TASK,
                                           json_system_prompt, parse_json_action)
from earl_megatron.rollout.tokenizer import render_prompt
from earl_megatron.rollout.trajectories import trajectory_tokens
from examples.agents.make_tasks import calculator_tasks, warm_start_traces


def _as_the_agent_sends(trace) -> list[dict]:
    """The trace's conversation as calculator_openai.agent's messages list."""
    msgs = [{"role": "system", "content": CALCULATOR_TASK}]
    for k, (role, content) in enumerate(trace.turns):
        kind, body = parse_json_action(content) if role == "assistant" else ("", "")
        if kind == "call":
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call{k}", "type": "function",
                 "function": {"name": "calculator",
                              "arguments": json.dumps({"expression": body})}}]})
        elif role == "tool":
            msgs.append({"role": "tool", "tool_call_id": f"call{k - 1}", "content": content})
        else:
            msgs.append({"role": role, "content": content})
    return msgs


def test_the_example_shows_the_model_its_warm_start(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    renderer = ChatRenderer(tok)
    traces = warm_start_traces(8)
    assert {len(t.turns) for t in traces} == {2, 4}          # with and without the tool
    for trace in traces:
        assert trace.system == json_system_prompt()
        msgs = _as_the_agent_sends(trace)
        prompt = renderer.messages_text(msgs[:2], [CALCULATOR_SCHEMA], True)
        assert prompt == tok.decode(render_prompt(tok, trace.system, trace.turns[0][1]))
        whole = renderer.messages_text(msgs, [CALCULATOR_SCHEMA], False)
        trained = tok.decode(trajectory_tokens(trace, tok)[0])
        assert whole == trained + renderer.fmt.turn_suffix, (whole, trained)


def test_the_example_entry_and_its_tasks():
    agent = resolve("examples.agents.calculator_openai:agent", "entry")
    assert agent.__name__ == "agent"
    tasks = calculator_tasks(3)
    assert all(t["question"].startswith("What is ") and isinstance(t["answer"], int)
               for t in tasks)
