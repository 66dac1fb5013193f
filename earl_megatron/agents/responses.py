"""The chat completion response bodies: one JSON object, or server-sent events when streamed.

Shapes are OpenAI's (``chat.completion`` and ``chat.completion.chunk``, as the ``openai``
package parses them). The sampled token ids ride along in ``choices[i].token_ids`` (in each
chunk, for the tokens it carries, when streamed): a client that wants them gets them, and the
server keeps them whatever the client does.

A stream: each choice's role chunk; then one chunk per token as the engine samples it (an
engine that streams, rollout/embedded_engine.py; from others the tokens come in the closing
chunk), its ``token_ids`` and, when asked, its ``logprobs`` entry; then per choice the content
not shown yet, each tool call (name, id and arguments in one delta, at its index) and the
finish reason; then the usage chunk (``stream_options.include_usage``) and ``data: [DONE]``.

``ChoiceStream`` decides what a token's chunk shows. Invariant: the shown content is always a
prefix of the final message's content, so the deltas join to exactly what the same completion
returns unstreamed. It holds back text that a stop string could still cut (agents/requests.py
``StopScan``), text from where a tool call could begin (the parser's ``content_prefix``) and
whitespace at either end (the content is stripped); tokens after a completed stop string are
not part of the reply and get no chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Iterator, Optional, Sequence

from earl_megatron.agents.requests import Detokenizer, StopScan, logprob_entry


def completion_body(cid: str, model: str, choices: Sequence[dict], usage: dict) -> dict:
    """``choices``: dicts of message, finish, ids and logprobs (OpenAI's object or None)."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "message": c["message"], "finish_reason": c["finish"],
                         "logprobs": c["logprobs"], "token_ids": list(c["ids"])}
                        for i, c in enumerate(choices)],
            "usage": usage}


class ChoiceStream:
    """One choice's content as its tokens arrive (module docstring). ``parser``: the chat
    format's tool-call parser, None for tool_choice "none"."""

    def __init__(self, tokenizer, stops: list[str], parser=None, logprobs: bool = False):
        self.detok, self.scan = Detokenizer(tokenizer), StopScan(stops)
        self.parser, self.logprobs = parser, logprobs
        self.sent = ""
        self.tokens = 0
        """Tokens that got a chunk (the first ``tokens`` of the recorded completion)."""

    def add(self, token_id: int, logprob: float) -> Optional[dict]:
        """A sampled token's chunk fields (delta, logprobs, token_ids); None past a stop
        string."""
        if self.scan.cut is not None:
            return None
        piece = self.detok.add(token_id)
        self.scan.add(piece)
        self.tokens += 1
        text = self.scan.text[:len(self.scan.text) - self.scan.held]
        if self.parser is not None:
            text = text[:self.parser.content_prefix(text)]
        shown = text.strip()
        delta = shown[len(self.sent):] if shown.startswith(self.sent) else ""
        self.sent += delta
        return {"delta": {"content": delta} if delta else {}, "token_ids": [int(token_id)],
                "logprobs": {"content": [logprob_entry(piece, logprob)], "refusal": None}
                if self.logprobs else None}


class Events:
    """Server-sent event lines of one streamed completion."""

    def __init__(self, cid: str, model: str, include_usage: bool):
        self.cid, self.model, self.include_usage = cid, model, include_usage
        self.created = int(time.time())

    def chunk(self, i: int, delta: dict, finish_reason=None, logprobs=None, **extra) -> str:
        body = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": i, "delta": delta, "finish_reason": finish_reason,
                             "logprobs": logprobs, **extra}]}
        if self.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    def closing(self, choices: Sequence[dict], usage: dict,
                streams: Sequence[Optional[ChoiceStream]]) -> Iterator[str]:
        """Per choice what its token chunks did not show, its tool calls and finish reason;
        the usage; [DONE]. ``streams[i]`` None: nothing of choice i was sent yet."""
        for i, (c, s) in enumerate(zip(choices, streams, strict=True)):
            message, sent, n = c["message"], s.sent if s else "", s.tokens if s else 0
            if s is None:
                yield self.chunk(i, {"role": "assistant", "content": ""})
            content = message.get("content") or ""
            rest = content[len(sent):] if content.startswith(sent) else ""
            lps = c["logprobs"]
            if rest or n < len(c["ids"]):
                yield self.chunk(i, {"content": rest} if rest else {}, token_ids=list(c["ids"][n:]),
                                 logprobs={"content": lps["content"][n:], "refusal": None}
                                 if lps else None)
            for k, call in enumerate(message.get("tool_calls") or []):
                yield self.chunk(i, {"tool_calls": [{"index": k, "id": call["id"],
                                                     "type": "function",
                                                     "function": dict(call["function"])}]})
            yield self.chunk(i, {}, c["finish"])
        if self.include_usage:
            yield "data: " + json.dumps({"id": self.cid, "object": "chat.completion.chunk",
                                         "created": self.created, "model": self.model,
                                         "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> Iterator[str]:
        """A refusal after the stream began (OpenAI's error object as an event; the openai
        package raises it)."""
        yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"


def stream_body(cid: str, model: str, choices: Sequence[dict], usage: dict,
                include_usage: bool) -> Iterator[str]:
    """A whole completion as a stream (nothing of it sent before)."""
    return Events(cid, model, include_usage).closing(choices, usage, [None] * len(choices))


def streamed(server, ep, prompt, req: dict, params, cid: str, unlock):
    """The StreamingResponse of a chat call on ``server`` (agents/server.py): chunks as the
    engine samples them. The completion is recorded by a task of its own, whether or not the
    client reads on; ``unlock`` (the episode's lock) is released once it is."""
    from fastapi.responses import StreamingResponse

    loop, heard = asyncio.get_running_loop(), asyncio.Queue()

    def hear(i):   # called on the driver's thread; the queue is the event loop's
        return lambda token, logprob: loop.call_soon_threadsafe(heard.put_nowait,
                                                                (i, token, logprob))

    futs = [server.broker.submit(prompt.ids, params, hear(i)) for i in range(req["n"])]
    for i, f in enumerate(futs):   # after its tokens: the driver answers after decoding
        f.add_done_callback(lambda _, i=i: loop.call_soon_threadsafe(heard.put_nowait,
                                                                     (i, None, None)))
    recorded = asyncio.ensure_future(server._finish(ep, prompt, req, futs))
    if unlock is not None:
        recorded.add_done_callback(lambda _: unlock())
    parser = server.renderer.parser if req["tool_choice"] != "none" else None
    streams = [ChoiceStream(server.renderer.tokenizer, req["stop"], parser, req["logprobs"])
               for _ in futs]
    events = Events(cid, server.model_name, req["include_usage"])

    async def body():
        for i in range(len(futs)):
            yield events.chunk(i, {"role": "assistant", "content": ""})
        left = len(futs)
        while left:
            i, token, logprob = await heard.get()
            part = None if token is None else streams[i].add(token, logprob)
            left -= token is None
            if part is not None:
                yield events.chunk(i, **part)
        got = await recorded
        lines = events.closing(*got, streams) if isinstance(got, tuple) else \
            events.error(json.loads(got.body))
        for line in lines:
            yield line

    answer = StreamingResponse(body(), media_type="text/event-stream")
    answer.unlocks_later = unlock is not None
    return answer
