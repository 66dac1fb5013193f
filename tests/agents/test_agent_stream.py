"""Streaming as tokens are sampled: the embedded engine (tiny Llama, one rank) reports each
token to the endpoint, which sends a chunk per token (OpenAI's chat.completion.chunk).

Counted, not timed: the engine is paused inside its per-token report after the first token
until the client has that token's chunk in hand; the engine's step counter read then is below
the completion's length (an endpoint that sends only after the completion would never release
it: the pause gives up after ``GATE_S`` and the count then equals the length). The same
request unstreamed, in another episode, samples the same tokens (same seed): the streamed
deltas join to its content, the chunks' ids and logprobs are its, and both episodes record the
same token ids."""

import json

from earl_megatron.testing.multiproc import run_distributed

MSGS = [{"role": "user", "content": "count: 1 2 3"}]
GATE_S = 300.0


def _stream_checks():
    import threading

    import httpx

    from earl_megatron.agents.broker import Broker, ReplicaDriver
    from earl_megatron.agents.server import AgentServer, ServerLimits
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.tokenizer import char_tokenizer
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.tiny_models import tiny_model

    cfg = tiny_model("llama")
    with cpu_backend():
        mol = build_on_layout(cfg, ParallelLayout(), weights=reference_weights(cfg, seed=3),
                              ddp=False)
    engine = EmbeddedEngine(mol, prompts="replica")
    seen_chunk, at_first = threading.Event(), {}

    class Paused:   # the real engine, paused in its report of a stream's first token
        streams_tokens = True

        def generate(self, prompts, params, on_token=None):
            def report(row, token, logprob):
                on_token(row, token, logprob)
                if not at_first:
                    at_first["waited"] = seen_chunk.wait(GATE_S)
            with cpu_backend():
                return engine.generate(prompts, params,
                                       on_token=report if on_token else None)

    broker = Broker(window_s=0.0)
    server = AgentServer(char_tokenizer(), broker, ServerLimits(
        max_context_tokens=256, max_action_tokens=16, max_turns=4))
    server.start()
    stop = threading.Event()
    driver = threading.Thread(target=ReplicaDriver(Paused()).lead,
                              args=(broker, stop.is_set, lambda k: 7), daemon=True)
    driver.start()
    head = {"Authorization": f"Bearer {server.api_key}"}
    try:
        plain_ep, stream_ep = server.open_episode({}), server.open_episode({})
        plain = httpx.post(plain_ep.base_url + "/v1/chat/completions", headers=head, timeout=600,
                           json={"messages": MSGS, "max_tokens": 16, "logprobs": True}).json()
        chunks, steps_at_first, before = [], None, engine.stats["steps"]
        with httpx.stream("POST", stream_ep.base_url + "/v1/chat/completions", headers=head,
                          timeout=600, json={"messages": MSGS, "max_tokens": 16, "stream": True,
                                             "logprobs": True,
                                             "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:]))
                ch = chunks[-1]["choices"]
                if steps_at_first is None and ch and ch[0].get("token_ids"):
                    steps_at_first = engine.stats["steps"] - before   # this call's steps
                    seen_chunk.set()
        rows = [[list(row.token_ids) for row in ep.tokens.rows()]
                for ep in (plain_ep, stream_ep)]
        return {"plain": plain, "chunks": chunks, "steps_at_first": steps_at_first,
                "waited": at_first.get("waited"), "rows": rows}
    finally:
        seen_chunk.set()
        stop.set()
        broker.wake()
        driver.join(timeout=60)
        server.stop()


def test_chunks_stream_as_tokens_are_sampled_and_record_the_same_tokens():
    from openai.types.chat import ChatCompletionChunk

    got = run_distributed(_stream_checks, 1, timeout=900)[0]
    plain = got["plain"]["choices"][0]
    ids = plain["token_ids"]
    assert len(ids) >= 2, "pick MSGS or the seed so that the completion is 2+ tokens"
    # the first token's chunk reached the client while the engine had sampled 1 of len(ids)
    assert got["waited"] is True and got["steps_at_first"] == 1 < len(ids)
    chunks = [ChatCompletionChunk.model_validate(c) for c in got["chunks"]]
    per_token = [c for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids")]
    assert [c.choices[0].model_extra["token_ids"] for c in per_token] == [[i] for i in ids]
    assert [lp.logprob for c in per_token for lp in c.choices[0].logprobs.content] == \
        [lp["logprob"] for lp in plain["logprobs"]["content"]]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (plain["message"]["content"] or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain["finish_reason"]
    assert chunks[-1].usage.completion_tokens == len(ids) == got["plain"]["usage"][
        "completion_tokens"]
    plain_rows, stream_rows = got["rows"]
    assert plain_rows == stream_rows and len(plain_rows) == 1
