"""The chat completion response bodies: one JSON object, or server-sent events when streamed.

Shapes are OpenAI's (``chat.completion`` and ``chat.completion.chunk``, as the ``openai``
package parses them). The sampled token ids ride along in ``choices[0].token_ids`` (in the last
content chunk when streamed): a client that wants them gets them, and the server keeps them
whatever the client does. A streamed answer is the whole completion cut into chunks (the
engine decodes a batch at once): the role, the content, each tool call (name, id and arguments
in one delta, at its index), the finish reason, then the usage chunk when the client asked for
it (``stream_options.include_usage``), then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
from typing import Iterator, Sequence


def completion_body(cid: str, model: str, choices: Sequence[dict], usage: dict) -> dict:
    """``choices``: dicts of message, finish, ids and logprobs (OpenAI's object or None)."""
    return {"id": cid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None,
            "choices": [{"index": i, "message": c["message"], "finish_reason": c["finish"],
                         "logprobs": c["logprobs"], "token_ids": list(c["ids"])}
                        for i, c in enumerate(choices)],
            "usage": usage}


def stream_body(cid: str, model: str, choices: Sequence[dict], usage: dict,
                include_usage: bool) -> Iterator[str]:
    created = int(time.time())

    def chunk(i: int, delta: dict, finish_reason=None, logprobs=None, **extra) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model, "system_fingerprint": None,
                "choices": [{"index": i, "delta": delta, "finish_reason": finish_reason,
                             "logprobs": logprobs, **extra}]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    for i, c in enumerate(choices):
        message = c["message"]
        yield chunk(i, {"role": "assistant", "content": ""})
        delta = {"content": message["content"]} if message.get("content") else {}
        yield chunk(i, delta, logprobs=c["logprobs"], token_ids=list(c["ids"]))
        for k, call in enumerate(message.get("tool_calls") or []):
            yield chunk(i, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": dict(call["function"])}]})
        yield chunk(i, {}, c["finish"])
    if include_usage:
        yield f"data: {json.dumps({'id': cid, 'object': 'chat.completion.chunk', 'created': created, 'model': model, 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"
