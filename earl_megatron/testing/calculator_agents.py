"""A calculator agent written with each client library its users write agents with, for
``env.name=agent`` on a real model (tests/real/test_real_agents.py):

    env.kwargs.entry=earl_megatron.testing.calculator_agents:calculator_client

``calculator_client`` (``client`` in the task row: ``openai``, ``openai_async``,
``openai_stream``, ``agents_sdk``, ``langgraph``) solves a calculator task with that client, a
Python tool function and three worked examples in its messages (enough for SmolLM2-135M to call
the tool greedily); reward 1 for the right answer.
"""

from __future__ import annotations

import json

import httpx

CLIENTS = ("openai", "openai_async", "openai_stream", "agents_sdk", "langgraph")
CALC_SYSTEM = "Always call the calculator tool first, then answer."
CALC_ROUNDS = 3
"""Calls an agent makes at most: the tool call, the answer, one spare."""
CALC_MAX_TOKENS = 48
WORKED = (("What is 17*23?", "17*23", "391"), ("What is 45+78?", "45+78", "123"),
          ("What is 96-39?", "96-39", "57"))
"""Three worked examples (question, expression, value) sent before the task's question."""


class _Calculator:
    """The Python tool every client runs; counts its calls."""

    def __init__(self):
        self.fired = 0

    def __call__(self, expression: str) -> str:
        from earl_megatron.envs.tool_env import format_number, safe_eval

        self.fired += 1
        try:
            return format_number(safe_eval(expression))
        except ValueError as e:
            return f"error: {e}"


def _openai_examples(question: str) -> list[dict]:
    msgs = [{"role": "system", "content": CALC_SYSTEM}]
    for k, (q, expr, value) in enumerate(WORKED):
        call = {"id": f"ex{k}", "type": "function",
                "function": {"name": "calculator",
                             "arguments": json.dumps({"expression": expr})}}
        msgs += [{"role": "user", "content": q},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"ex{k}", "content": value},
                 {"role": "assistant", "content": f"<answer>{value}</answer>"}]
    return msgs + [{"role": "user", "content": question}]


def _reward(task: dict, text: str) -> float:
    import re

    match = re.search(r"<answer>\s*(-?[\d.]+)\s*</answer>", text or "")
    try:
        return float(match is not None and abs(float(match.group(1)) - float(task["answer"]))
                     < 1e-6)
    except ValueError:
        return 0.0


def _tool_round(msgs: list, calls, calc: _Calculator) -> None:
    """Run each tool call and append its result as a role "tool" message."""
    for call in calls:
        try:
            expression = json.loads(call["function"]["arguments"]).get("expression", "")
        except (json.JSONDecodeError, AttributeError):
            expression = ""
        msgs.append({"role": "tool", "tool_call_id": call["id"],
                     "content": calc(str(expression))})


def _message_dict(message) -> dict:
    out = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    return out


def _streamed(chunks) -> dict:
    """An assistant message assembled from streamed chunks, as users do: content deltas
    concatenated, tool-call deltas merged by index."""
    content, calls = [], {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            content.append(delta.content)
        for d in delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": "", "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
    out = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        out["tool_calls"] = [calls[k] for k in sorted(calls)]
    return out


def _solve_openai(task, base_url, api_key, model, calc, stream=False) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    msgs = _openai_examples(task["question"])
    for _ in range(CALC_ROUNDS):
        kwargs = dict(model=model, messages=msgs, tools=[_schema()],
                      max_tokens=CALC_MAX_TOKENS)
        if stream:
            msg = _streamed(client.chat.completions.create(stream=True, **kwargs))
        else:
            msg = _message_dict(client.chat.completions.create(**kwargs).choices[0].message)
        msgs.append(msg)
        if not msg.get("tool_calls"):
            return msg["content"] or ""
        _tool_round(msgs, msg["tool_calls"], calc)
    return ""


async def _solve_openai_async(task, base_url, api_key, model, calc) -> str:
    from openai import AsyncOpenAI

    msgs = _openai_examples(task["question"])
    # closed before the trainer's event loop ends (an unclosed client's cleanup task would
    # meet a closed loop)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2) as client:
        for _ in range(CALC_ROUNDS):
            r = await client.chat.completions.create(model=model, messages=msgs,
                                                     tools=[_schema()],
                                                     max_tokens=CALC_MAX_TOKENS)
            msg = _message_dict(r.choices[0].message)
            msgs.append(msg)
            if not msg.get("tool_calls"):
                return msg["content"] or ""
            _tool_round(msgs, msg["tool_calls"], calc)
    return ""


async def _solve_agents_sdk(task, base_url, api_key, model, calc) -> str:
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. 17*23."""
        return calc(expression)

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    agent = agents.Agent(
        name="calculator", instructions=CALC_SYSTEM, tools=[calculator],
        model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=agents.ModelSettings(max_tokens=CALC_MAX_TOKENS))
    items: list = []
    for k, (q, expr, value) in enumerate(WORKED):
        items += [{"role": "user", "content": q},
                  {"type": "function_call", "call_id": f"ex{k}", "name": "calculator",
                   "arguments": json.dumps({"expression": expr})},
                  {"type": "function_call_output", "call_id": f"ex{k}", "output": value},
                  {"role": "assistant", "content": f"<answer>{value}</answer>"}]
    items.append({"role": "user", "content": task["question"]})
    try:
        result = await agents.Runner.run(agent, items, max_turns=CALC_ROUNDS)
    except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):
        return ""   # calls past CALC_ROUNDS, or a call of a tool that does not exist
    finally:
        await client.close()
    return str(result.final_output or "")


async def _solve_langgraph(task, base_url, api_key, model, calc) -> str:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. 17*23."""
        return calc(expression)

    http = httpx.AsyncClient(timeout=None)  # its own, closed below (langchain-openai's default
    # async client is shared process-wide and bound to the first event loop that used it)
    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, http_async_client=http,
                     max_tokens=CALC_MAX_TOKENS, max_retries=2).bind_tools([calculator])

    async def call_model(state: MessagesState):
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([calculator]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    app = graph.compile()
    msgs = [SystemMessage(CALC_SYSTEM)]
    for k, (q, expr, value) in enumerate(WORKED):
        msgs += [HumanMessage(q),
                 AIMessage("", tool_calls=[{"name": "calculator", "id": f"ex{k}",
                                            "args": {"expression": expr}}]),
                 ToolMessage(value, tool_call_id=f"ex{k}"),
                 AIMessage(f"<answer>{value}</answer>")]
    msgs.append(HumanMessage(task["question"]))
    from langgraph.errors import GraphRecursionError

    try:  # a step is one node: model, tools, model... CALC_ROUNDS model calls at most
        out = await app.ainvoke({"messages": msgs},
                                {"recursion_limit": 2 * CALC_ROUNDS - 1})
    except GraphRecursionError:
        return ""
    finally:
        await http.aclose()
    last = out["messages"][-1]
    return last.content if isinstance(last.content, str) else ""


def _schema() -> dict:
    from earl_megatron.envs.tool_calls import CALCULATOR_SCHEMA

    return CALCULATOR_SCHEMA


async def calculator_client(task: dict, base_url: str, api_key: str, model: str) -> dict:
    """Solve a calculator task ({"question", "answer", "client"}) with ``task["client"]``
    (module docstring); reward 1 for the right <answer>, info: client, tool_calls_fired."""
    import asyncio

    client, calc = task["client"], _Calculator()
    if client in ("openai", "openai_stream"):
        text = await asyncio.to_thread(_solve_openai, task, base_url, api_key, model, calc,
                                       client == "openai_stream")
    elif client == "openai_async":
        text = await _solve_openai_async(task, base_url, api_key, model, calc)
    elif client == "agents_sdk":
        text = await _solve_agents_sdk(task, base_url, api_key, model, calc)
    elif client == "langgraph":
        text = await _solve_langgraph(task, base_url, api_key, model, calc)
    else:
        raise ValueError(f"task client {client!r}: use one of {CLIENTS}")
    return {"reward": _reward(task, text),
            "info": {"client": client, "tool_calls_fired": calc.fired, "final": text[:200]}}
