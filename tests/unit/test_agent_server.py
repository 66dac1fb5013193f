"""The agent endpoint's parts that need no model: the broker's batching rule, the request
checks, every refusal the server answers before the engine (a real uvicorn server on loopback,
real HTTP), the response shapes as the ``openai`` package parses them, and the agent programs'
rewards, failures and files (agents/programs.py). The engine's side runs in
tests/agents/test_agent_env.py (tiny model) and tests/real/test_real_agents.py (SmolLM2)."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from earl_megatron.agents.broker import Broker
from earl_megatron.agents.chat import ChatRequestError
from earl_megatron.agents.programs import (AgentConfigError, load_tasks, resolve, run_agents)
from earl_megatron.agents.requests import (completion_budget, logprobs_body, parse_request,
                                           stop_cut, token_texts)
from earl_megatron.agents.responses import completion_body, stream_body
from earl_megatron.agents.server import AgentServer, ServerLimits, base_url
from earl_megatron.rollout.engine import Generation, SamplingParams
from earl_megatron.rollout.tokenizer import char_tokenizer

P1 = SamplingParams(max_new_tokens=4)
P2 = SamplingParams(max_new_tokens=8)


def test_broker_sends_at_once_when_every_open_episode_waits():
    b = Broker(window_s=60.0)
    b.open_episodes = 2
    b.submit([1], P1)
    t0 = time.monotonic()
    assert b.take(0.05) == []                      # one of two waits: the window holds it
    b.submit([2], P1)
    batch = b.take(5.0)
    assert [r.prompt for r in batch] == [(1,), (2,)] and time.monotonic() - t0 < 5.0


def test_broker_window_releases_a_partial_batch_and_groups_by_params():
    b = Broker(window_s=0.01)
    b.open_episodes = 5
    b.submit([1], P1)
    b.submit([2], P2)
    b.submit([3], P1)
    first = b.take(5.0)
    assert [r.prompt for r in first] == [(1,), (3,)]   # one generate call takes one params
    assert [r.prompt for r in b.take(5.0)] == [(2,)]
    assert b.take(0.01) == []


def test_broker_fail_all_answers_every_waiting_request():
    b = Broker()
    futs = [b.submit([k], P1) for k in range(3)]
    b.fail_all(RuntimeError("over"))
    for f in futs:
        with pytest.raises(RuntimeError, match="over"):
            f.result(timeout=1)


@pytest.mark.parametrize("body,match", [
    ([], "JSON object"), ({}, "messages"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n=3.*agent_max_batch"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "does not constrain decoding"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "'f'.*constrain"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2},
     "sampled token's logprob only"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n=0"),
])
def test_parse_request_names_the_bad_field(body, match):
    with pytest.raises(ChatRequestError, match=match):
        parse_request(body, "policy")


def test_parse_request_reads_openai_fields():
    req = parse_request({"messages": [{"role": "user", "content": "x"}], "stop": "\n",
                         "max_completion_tokens": 7, "stream": True,
                         "stream_options": {"include_usage": True}, "seed": 3}, "policy")
    assert (req["stop"], req["max_tokens"], req["stream"], req["include_usage"], req["seed"]) \
        == (["\n"], 7, True, True, 3)


@pytest.fixture
def server():
    s = AgentServer(char_tokenizer(), Broker(), ServerLimits(max_context_tokens=64,
                                                             max_action_tokens=4, max_turns=2))
    s.start()
    yield s
    s.stop()


def _call(url, key, body=None, raw=None):
    r = httpx.post(url, headers={"Authorization": f"Bearer {key}"},
                   content=raw if raw is not None else json.dumps(body), timeout=30)
    return r.status_code, r.json()["error"]["code"] if r.status_code >= 400 else None, r


def test_every_refusal_before_the_engine(server):
    ep = server.open_episode({"q": 1})
    url = ep.base_url + "/v1/chat/completions"
    ok = {"messages": [{"role": "user", "content": "hi"}]}
    assert _call(url, "nope", ok)[:2] == (401, "invalid_api_key")
    assert _call(url.replace(ep.id, ep.id + "x"), server.api_key, ok)[:2] == \
        (404, "episode_not_found")
    assert _call(url, server.api_key, raw=b"{oops")[:2] == (400, "invalid_request")
    assert _call(url, server.api_key, {"messages": [{"role": "wizard", "content": "x"}]})[0] \
        == 400
    code, err, r = _call(url, server.api_key, {"messages": [{"role": "user",
                                                             "content": "y" * 200}]})
    assert (code, err) == (400, "context_length_exceeded") and "64" in r.json()["error"][
        "message"]
    server.pause()
    code, err, r = _call(url, server.api_key, ok)
    assert (code, err, r.headers["retry-after"]) == (503, "weights_updating", "1")
    server.resume()
    assert not ep.tokens.rows()          # no refusal changed the episode
    server.close_episode(ep)
    assert _call(url, server.api_key, ok)[:2] == (410, "episode_finished")
    models = httpx.get(ep.base_url.rsplit("/episodes", 1)[0] + "/v1/models",
                       headers={"Authorization": f"Bearer {server.api_key}"})
    assert models.json()["data"][0]["id"] == "policy"
    # training serves episodes only: the bare path tells the client what to use
    assert _call(server.url + "/v1/chat/completions", server.api_key, ok)[:2] == \
        (404, "not_found")


def test_response_shapes_parse_with_the_openai_package():
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a_0", "type": "function",
         "function": {"name": "calculator", "arguments": "{\"expression\": \"1+2\"}"}}]}
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    lps = logprobs_body(char_tokenizer(), [40, 41, 42], [-0.5, -1.0, -2.0])
    choice = {"message": msg, "finish": "tool_calls", "ids": [7, 8, 9], "logprobs": lps}
    c = ChatCompletion.model_validate(completion_body("c1", "policy", [choice], usage))
    assert c.choices[0].message.tool_calls[0].function.name == "calculator"
    assert c.choices[0].model_extra["token_ids"] == [7, 8, 9]
    assert [t.logprob for t in c.choices[0].logprobs.content] == [-0.5, -1.0, -2.0]
    events = list(stream_body("c1", "policy", [choice], usage, True))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events[:-1]]
    assert chunks[-1].usage.total_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


# ------------------------------------------------------------------ agent programs
def test_resolve_and_tasks_errors_name_the_fix(tmp_path):
    with pytest.raises(AgentConfigError, match="package.module:function"):
        resolve("nocolon", "entry")
    with pytest.raises(AgentConfigError, match="cannot import"):
        resolve("no_such_pkg_xyz:f", "entry")
    with pytest.raises(AgentConfigError, match="has no 'nope'"):
        resolve("json:nope", "reward")
    with pytest.raises(AgentConfigError, match="no such file"):
        load_tasks(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(AgentConfigError, match="bad.jsonl:2"):
        load_tasks(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert load_tasks(str(good)) == [{"a": 1}, {"a": 2}]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"q": "1+1", "answer": 2}, {"q": "2*3", "answer": 6}]),
                   tmp_path / "tasks.parquet")
    assert load_tasks(str(tmp_path / "tasks.parquet"))[1] == {"q": "2*3", "answer": 6}


def test_run_agents_rewards_failures_and_timeouts(server):
    def agent(task, base_url, api_key, model):
        if task["k"] == "raise":
            raise ValueError("boom\nsecond line")
        if task["k"] == "hang":
            threading.Event().wait()
        if task["k"] == "none":
            return None
        return {"reward": 2.0, "info": {"x": 1}} if task["k"] == "dict" else 1

    async def coro(task, base_url, api_key, model):
        await asyncio.sleep(0)
        return 0.25

    tasks = [{"k": k} for k in ("num", "dict", "raise", "hang", "none")]
    out = run_agents(server, tasks, agent, lambda task, msgs: -1.0, concurrency=2,
                     timeout_s=2.0)
    assert [o.reward for o in out] == [1.0, 2.0, 0.0, 0.0, -1.0]
    assert out[1].info == {"x": 1} and out[2].error.endswith("second line")
    assert out[3].timed_out and not out[3].error
    # every episode closed, in every case, and the broker waits on none of them
    assert len(server.finished) == len(tasks) and not server.episodes
    assert server.broker.open_episodes == 0
    none = run_agents(server, [{"k": "none"}], agent, None, concurrency=1, timeout_s=5)
    assert "no reward" in none[0].error
    assert run_agents(server, [{}], coro, None, concurrency=1, timeout_s=5)[0].reward == 0.25


_KEPT: dict = {}


async def _kept_client_agent(task, base_url, api_key, model):
    """An agent that keeps one async client for the whole process, as langchain-openai does."""
    client = _KEPT.setdefault("client", httpx.AsyncClient())
    r = await client.get(base_url + "/models", headers={"Authorization": f"Bearer {api_key}"})
    return float(r.status_code == 200)


def test_a_client_kept_between_rollouts_stays_usable(server):
    """Every rollout's agents run on one event loop: an async client made in the first is
    still bound to a live loop in the second (a loop per rollout closes it under the client)."""
    for _ in range(2):
        out = run_agents(server, [{}, {}], _kept_client_agent, None, concurrency=2, timeout_s=30)
        assert [(o.reward, o.error) for o in out] == [(1.0, ""), (1.0, "")]


def test_broker_wake_returns_take_at_once_and_driver_names_the_version():
    import threading

    from earl_megatron.agents.broker import ReplicaDriver

    b = Broker(window_s=60.0)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(b.take(3600.0)), daemon=True)
    taker.start()
    b.wake()
    taker.join(timeout=120)                    # an hour's take, returned by the wake
    assert got == [[]]

    class Echo:
        def generate(self, prompts, params):
            return [Generation(tuple(p), (0.0,) * len(p), "length") for p in prompts]

    b.open_episodes = 1
    fut = b.submit([7, 8], P1)
    done = iter([False, True])
    assert ReplicaDriver(Echo(), version=4).lead(b, lambda: next(done), lambda k: k)
    assert fut.result(timeout=1).token_ids == (7, 8) and fut.version == 4


# ------------------------------------------------------------------ what a request asks for
def test_max_tokens_is_honoured_up_to_the_context_and_the_cap_is_named():
    assert completion_budget(20, 10, 100, None) == 20           # serve: no per-call cap
    assert completion_budget(None, 10, 100, None) == 90         # none asked: up to the context
    assert completion_budget(None, 10, 100, 4) == 4             # training: the cap
    assert completion_budget(3, 10, 100, 4) == 3
    assert completion_budget(None, 98, 100, 4) == 2             # the context bounds the cap
    with pytest.raises(ChatRequestError, match="rollout.max_action_tokens") as e:
        completion_budget(20, 10, 100, 4)
    assert e.value.code == "max_tokens_exceeded"
    with pytest.raises(ChatRequestError, match="at most 90") as e:
        completion_budget(91, 10, 100, None)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(ChatRequestError, match="context is 100") as e:
        completion_budget(None, 100, 100, None)


@pytest.mark.parametrize("make", ["char", "smollm2"])
def test_token_texts_join_to_the_decoded_text_and_the_stop_cut_is_the_first(make):
    if make == "char":
        tok = char_tokenizer()
    else:
        import pathlib

        from transformers import AutoTokenizer
        path = pathlib.Path("~/.cache/earl-models/SmolLM2-135M-Instruct").expanduser()
        if not path.is_dir():
            pytest.skip(f"SmolLM2's tokenizer is not cached at {path}")
        tok = AutoTokenizer.from_pretrained(path)
    text = "Hé llo, wörld! 🙂 then STOP here and STOP again"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = token_texts(tok, ids)
    def decode(some):
        return tok.decode(some, skip_special_tokens=True)

    assert len(pieces) == len(ids) and "".join(pieces) == decode(ids)
    k, cut = stop_cut(tok, ids, ["STOP", "never"])
    shown = decode(ids[:k])
    assert "STOP" in shown and "STOP" not in decode(ids[:k - 1])   # the first token to
    assert shown[:len(shown) - cut] == decode(ids).split("STOP")[0]  # complete it
    assert stop_cut(tok, ids, ["absent"]) is None and stop_cut(tok, ids, []) is None


def test_the_base_url_agents_are_handed():
    assert base_url("127.0.0.1", 5, None) == "http://127.0.0.1:5"
    assert base_url("0.0.0.0", 5, None) != "http://127.0.0.1:5"      # a name others reach
    assert base_url("0.0.0.0", 5, "https://proxy.example/{port}/") == \
        "https://proxy.example/5"


def test_body_limit_batch_cap_and_a_completion_after_close(tmp_path):
    """413 past the body limit (read no further); the broker's batches hold at most max_batch
    requests; a call waiting on the engine when its episode closes is answered 410 and the
    episode records nothing. The engine's side is this test answering the broker's futures."""
    broker = Broker(window_s=0.0, max_batch=2)
    s = AgentServer(char_tokenizer(), broker, ServerLimits(max_context_tokens=64,
                                                           max_action_tokens=4, max_turns=5),
                    max_body_bytes=2000)
    s.start()
    try:
        ep = s.open_episode({})
        url = ep.base_url + "/v1/chat/completions"
        big = {"messages": [{"role": "user", "content": "x" * 3000}]}
        assert _call(url, s.api_key, big)[:2] == (413, "request_too_large")
        got = {}
        body = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
        t = threading.Thread(target=lambda: got.update(r=_call(url, s.api_key, body)))
        t.start()
        batch = broker.take(30.0)
        assert len(batch) == 2                               # n=2: two requests, one batch
        for _ in range(3):
            broker.submit([1], P1)
        assert len(broker.take(5.0)) == 2 and len(broker.take(5.0)) == 1   # the cap
        s.close_episode(ep)                                  # the agent timed out meanwhile
        for r in batch:
            r.future.version = 0
            r.future.set_result(Generation((40, 41), (-0.1, -0.2), "length"))
        t.join(30)
        assert got["r"][:2] == (410, "episode_finished")
        assert ep.tokens.rows() == [] and ep.calls == 0
    finally:
        s.stop()


@pytest.mark.parametrize("text,stops,tools,shown", [
    ("Hi there END and more", ["END"], True, "Hi there"),      # cut at the stop string
    ("ab <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", [], True, "ab"),
    ("  spaced out  ", [], True, "spaced out"),                 # stripped at both ends
    ("x <tool_call> kept", [], False, "x <tool_call> kept"),    # tool_choice none: all text
])
def test_streamed_deltas_join_to_the_unstreamed_content(text, stops, tools, shown):
    """Each token's delta only ever extends a prefix of the final content: text a stop string
    or a tool call could still claim waits, and the closing chunk adds the rest."""
    from earl_megatron.agents.responses import ChoiceStream, Events
    from earl_megatron.agents.tool_parsers import HermesParser

    tok = char_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    s = ChoiceStream(tok, stops, HermesParser() if tools else None, logprobs=True)
    parts = [s.add(i, -0.5) for i in ids]
    sent = [p for p in parts if p is not None]
    cut = stop_cut(tok, ids, stops)
    assert len(sent) == (cut[0] if cut else len(ids))          # no chunk after a stop string
    streamed = "".join(p["delta"].get("content", "") for p in sent)
    full = tok.decode(ids[:len(sent)], skip_special_tokens=True)
    full = full[:len(full) - cut[1]] if cut else full
    reply = HermesParser().parse(full, "c") if tools else None
    content = reply.content if reply else full.strip()
    assert content == shown and streamed and shown.startswith(streamed)
    choice = {"message": {"role": "assistant", "content": content}, "finish": "stop",
              "ids": ids[:len(sent)], "logprobs": None}
    closing = list(Events("c", "policy", False).closing([choice], {}, [s]))
    rest = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "")
                   for e in closing[:-1])
    assert streamed + rest == shown
