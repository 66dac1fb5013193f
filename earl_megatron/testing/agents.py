"""Agent programs for the tests of ``env.name=agent``, written as their users write them.

    env.name=agent env.kwargs.entry=earl_megatron.testing.agents:probe
    env.kwargs.tasks=<a JSONL file whose rows have "kind">

``probe`` does what its task's ``kind`` says and reports what it saw in its reward's info:

- ``plain``: one call with the ``openai`` client, reward 1.
- ``refusals``: every refusal of the endpoint, each answer's status and error code recorded
  (``info["seen"]``): a wrong key, an unknown episode, a body that is not JSON, ``n=2``, a
  prompt over the context, then calls until the endpoint ends the episode (``max_turns``) and
  one more (the finished episode); reward 1 when every status is the documented one.
- ``fork``: two calls, the second with the first exchange edited (the episode forks).
- ``post``: one call, then the reward posted to ``{base}/reward``; returns None.
- ``builtin``: the built-in agent (agents/programs.py: the task's ``prompt`` sent once); the
  run's ``env.kwargs.reward`` (``score`` here) scores the conversation.
- ``raise``: raises (the episode is lost, ``agent_errors``).
- ``hang``: never returns (the episode times out, ``agent_timeouts``).
- ``hold``: ``plain`` until the file ``task["hold_when"]`` holds a line (the run's
  metrics.jsonl: iteration 0 recorded), then never returns: a stop request lands in that rollout by
  construction, whatever the machine's speed (as testing/envs.py's held game).

- ``late``: one call, then it outlives its episode (past ``rollout.agent_timeout_s``): it waits
  until the run's samples directory holds one more file than when it started (the stage it
  played in ended and trained), calls again and appends that answer's (status, code) to the
  file ``task["late_log"]``: a late call inside a training run, refused (410) by construction.
- ``span``: one call, then waits until the file ``task["span_after"]`` holds a line (the run's
  samples of iteration 0: its TRAIN step is done), then a second call extending the first: under
  asynchronous RL an episode that started before that step finishes after it, by construction.

``calculator_client`` (``client`` in the task row: ``openai``, ``openai_async``,
``openai_stream``, ``agents_sdk``, ``langgraph``) solves a calculator task with that client, a
Python tool function and three worked examples in its messages (enough for SmolLM2-135M to call
the tool greedily); reward 1 for the right answer.
"""

from __future__ import annotations

import json
import os
import threading

import httpx

SEEN_OK = {"wrong_key": 401, "unknown_episode": 404, "not_json": 400, "n_over_cap": 400,
           "too_long": 400, "over_cap": 400, "tool_required": 400, "max_turns": 400,
           "finished": 410}


def _post(url: str, key: str, body, raw: bool = False):
    r = httpx.post(url, headers={"Authorization": f"Bearer {key}"},
                   content=body if raw else json.dumps(body), timeout=None)
    try:
        code = r.json().get("error", {}).get("code")
    except ValueError:
        code = None
    return r.status_code, code


def _has_a_line(path: str) -> bool:
    try:
        with open(path) as f:
            return f.readline().endswith("\n")
    except FileNotFoundError:
        return False


def probe(task: dict, base_url: str, api_key: str, model: str):
    from openai import OpenAI

    kind = task["kind"]
    msgs = [{"role": "user", "content": task.get("prompt", "hi")}]
    if kind == "builtin":
        import asyncio

        from earl_megatron.agents.programs import builtin_agent
        return asyncio.run(builtin_agent(task, base_url, api_key, model))
    if kind == "raise":
        raise RuntimeError("this agent fails on purpose")
    if kind == "hang" or (kind == "hold" and _has_a_line(task["hold_when"])):
        threading.Event().wait()
    kind = "plain" if kind == "hold" else kind
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    if kind == "late":
        samples = task["samples_dir"]
        before = len(os.listdir(samples)) if os.path.isdir(samples) else 0
        client.chat.completions.create(model=model, messages=msgs)
        while not (os.path.isdir(samples) and len(os.listdir(samples)) > before):
            threading.Event().wait(0.05)
        seen = _post(base_url + "/chat/completions", api_key, {"messages": msgs})
        with open(task["late_log"], "a") as f:
            f.write(json.dumps(list(seen)) + "\n")
        return 1.0
    if kind == "span":
        r = client.chat.completions.create(model=model, messages=msgs)
        while not _has_a_line(task["span_after"]):
            threading.Event().wait(0.05)
        more = msgs + [{"role": "assistant", "content": r.choices[0].message.content or ""},
                       {"role": "user", "content": "and again"}]
        client.chat.completions.create(model=model, messages=more)
        return 1.0
    if kind == "plain":
        r = client.chat.completions.create(model=model, messages=msgs)
        return {"reward": 1.0, "info": {"finish": r.choices[0].finish_reason}}
    if kind == "parity":   # a reward that varies with what was sampled: 1 for an even length
        r = client.chat.completions.create(model=model, messages=msgs)
        return float(len(r.choices[0].message.content or "") % 2 == 0)
    if kind == "post":
        client.chat.completions.create(model=model, messages=msgs)
        httpx.post(base_url.removesuffix("/v1") + "/reward", json={"reward": 0.5},
                   headers={"Authorization": f"Bearer {api_key}"}).raise_for_status()
        return None
    if kind == "fork":
        r = client.chat.completions.create(model=model, messages=msgs)
        edited = msgs + [{"role": "assistant", "content": "(edited) " +
                          (r.choices[0].message.content or "")},
                         {"role": "user", "content": "again"}]
        client.chat.completions.create(model=model, messages=edited)
        return 1.0
    assert kind == "refusals", kind
    url = base_url + "/chat/completions"
    seen = {"wrong_key": _post(url, "wrong", {"messages": msgs}),
            "unknown_episode": _post(url.replace("/episodes/", "/episodes/x"), api_key,
                                     {"messages": msgs}),
            "not_json": _post(url, api_key, b"{not json", raw=True),
            "n_over_cap": _post(url, api_key, {"messages": msgs, "n": 10_000}),
            "over_cap": _post(url, api_key, {"messages": msgs, "max_tokens": 10_000}),
            "tool_required": _post(url, api_key, {"messages": msgs, "tool_choice": "required"}),
            "too_long": _post(url, api_key, {"messages": [{"role": "user",
                                                            "content": "x" * 100_000}]})}
    for _ in range(task["max_turns"]):
        client.chat.completions.create(model=model, messages=msgs)
    seen["max_turns"] = _post(url, api_key, {"messages": msgs})
    seen["finished"] = _post(url, api_key, {"messages": msgs})
    ok = all(seen[k][0] == v for k, v in SEEN_OK.items())
    return {"reward": float(ok), "info": {"seen": {k: list(v) for k, v in seen.items()}}}


def score(task: dict, messages: list) -> dict:
    """The run's reward function: 0.25 for a conversation that ends with the model's reply."""
    ok = messages[-1]["role"] == "assistant" and messages[0]["content"] == task["prompt"]
    return {"reward": 0.25 if ok else -1.0, "info": {"scored_messages": len(messages)}}


# --------------------------------------------------------------------------- calculator_client

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


def serve_process(*overrides: str, key: str = "test-key", timeout_s: float = 300.0,
                  module: tuple = ("earl_megatron.serve",)):
    """``python -m earl_megatron.serve *overrides`` started as a user starts it (``module``
    ("earl_megatron.cli", "serve"): ``earl serve``), and the URL it printed once listening:
    (process, base_url). The caller ends the process."""
    import re
    import subprocess
    import sys
    import time

    env = dict(os.environ, HF_HUB_OFFLINE="1", EARL_API_KEY=key)
    proc = subprocess.Popen([sys.executable, "-m", *module, *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + timeout_s
    while True:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.search(rf"at (http://\S+/v1) \(model 'policy', api key {key}\)", line)
        if m:
            return proc, m.group(1)
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("earl_megatron.serve did not start:\n" + "".join(lines)[-3000:])
