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

``serve_process`` starts ``earl serve`` as a user does. The calculator agents written with each
client library are earl_megatron/testing/calculator_agents.py's.
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
