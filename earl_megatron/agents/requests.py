"""A chat completions request, checked, and what the server derives from one: the tokens a call
may sample, the stop-string cut, OpenAI's ``logprobs`` object.

``parse_request`` reads the fields this server honours (agents/server.py's docstring lists them)
and raises ChatRequestError naming the field and the fix for anything it cannot honour:
``top_logprobs`` > 0 (the engines return the sampled token's logprob only), ``tool_choice``
``required`` or a named function (decoding is not constrained to a tool call), ``n`` above
``max_n``.

``completion_budget``: a request's ``max_tokens`` (or ``max_completion_tokens``) is honoured
when the prompt and it fit the context; without one a call samples up to the per-call cap, or
up to the context where there is none (``serve``). Training's per-call cap
(``rollout.max_action_tokens``) bounds every call: a request asking for more is refused with a
message naming the setting (a silent clamp would hand the agent a "length" it did not ask for).

``stop_cut``: the first token whose text completes a ``stop`` string, found in one pass over
incrementally detokenized text (``Detokenizer``: vLLM's incremental detokenizer, a step decodes
the few tokens since the last emitted text, not the whole completion; ``StopScan`` the search,
shared with the token-by-token stream of agents/responses.py).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from earl_megatron.agents.chat import ChatRequestError
from earl_megatron.agents.tool_parsers import marker_start

def parse_request(body: Any, default_model: str, max_n: int = 1) -> dict:
    """The fields of a chat completions request this server reads, checked (ChatRequestError
    names the field and the fix)."""
    if isinstance(body, ChatRequestError):
        raise body
    if not isinstance(body, dict):
        raise ChatRequestError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ChatRequestError("'messages' must be a non-empty list of chat messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatRequestError("'tools' must be a list of {\"type\": \"function\", "
                               "\"function\": {...}} objects")
    n = 1 if body.get("n") is None else body["n"]
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise ChatRequestError(f"n={n!r} must be an integer in [1, {max_n}] (the batch cap, "
                               "rollout.agent_max_batch)")

    def number(key, lo, hi):
        v = body.get(key)
        if v is None:
            return None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
            raise ChatRequestError(f"'{key}'={v!r} must be a number in [{lo}, {hi}]")
        return float(v)

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or
                                   isinstance(max_tokens, bool) or max_tokens < 1):
        raise ChatRequestError(f"max_tokens={max_tokens!r} must be an integer >= 1")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ChatRequestError("'stop' is a string or a list of up to 4 non-empty strings")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ChatRequestError(f"seed={seed!r} must be an integer")
    logprobs = body.get("logprobs") or False
    top = body.get("top_logprobs")
    if not isinstance(logprobs, bool) or (top is not None and (
            not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20)):
        raise ChatRequestError(f"logprobs={logprobs!r} must be a boolean and top_logprobs="
                               f"{top!r} an integer in [0, 20]")
    if top:
        raise ChatRequestError(f"top_logprobs={top}: this endpoint's engines return the sampled "
                               "token's logprob only; send logprobs=true with top_logprobs 0 "
                               "or omitted")
    top_p = number("top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise ChatRequestError("'top_p' must be in (0, 1]")
    opts = body.get("stream_options") or {}
    return {"messages": msgs, "tools": tools or None, "temperature": number("temperature", 0, 2),
            "top_p": top_p, "max_tokens": max_tokens, "stop": stop, "seed": seed, "n": n,
            "tool_choice": _tool_choice(body.get("tool_choice"), tools or []),
            "logprobs": logprobs, "stream": bool(body.get("stream", False)),
            "include_usage": bool(isinstance(opts, dict) and opts.get("include_usage")),
            "model": body.get("model") or default_model}


def _tool_choice(choice, tools: list) -> str:
    """"auto" or "none" (both honoured: "none" returns the reply as text, no call parsed); a
    choice that would need decoding constrained to a call is refused, saying why."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none"):
        return choice
    named = isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
        isinstance(choice["function"].get("name"), str)
    if choice == "required" or named:
        what = "required" if choice == "required" else \
            f"the function {choice['function']['name']!r}"
        raise ChatRequestError(f"tool_choice={what}: this endpoint does not constrain decoding "
                               "to a tool call (the model writes calls in its own format, "
                               "parsed afterwards); use tool_choice auto and ask for the call "
                               "in the prompt")
    raise ChatRequestError(f"tool_choice={choice!r}: use auto, none, required or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")


def completion_budget(max_tokens: Optional[int], prompt_tokens: int, context: int,
                      cap: Optional[int]) -> int:
    """Tokens a call samples at most (module docstring); ChatRequestError (with its code as
    ``.code``) when the request cannot be honoured."""
    room = context - prompt_tokens
    if room < 1:
        raise _coded(f"the prompt is {prompt_tokens} tokens; this model's context is {context} "
                     "(rollout.max_context_tokens)", "context_length_exceeded")
    if max_tokens is None:
        return min(room, cap) if cap is not None else room
    if cap is not None and max_tokens > cap:
        raise _coded(f"max_tokens={max_tokens} is above this run's per-call cap of {cap} "
                     f"tokens (rollout.max_action_tokens): ask for at most {cap}, or raise "
                     "rollout.max_action_tokens", "max_tokens_exceeded")
    if max_tokens > room:
        raise _coded(f"this model's context is {context} tokens (rollout.max_context_tokens); "
                     f"the prompt is {prompt_tokens} and max_tokens={max_tokens}: ask for at "
                     f"most {room}", "context_length_exceeded")
    return max_tokens


def _coded(message: str, code: str) -> ChatRequestError:
    e = ChatRequestError(message)
    e.code = code
    return e


class Detokenizer:
    """vLLM's incremental detokenizer: ``add`` returns each token's text as it extends the
    decoded completion (a step decodes the tokens since the previous emission and the ones
    before it, so the work is linear in the completion; the pieces join to ``decode(ids)``). A
    token that ends inside a multi-byte character gets "", the token completing it the whole
    character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, token_id: int) -> str:
        ids, dec = self.ids, self.tokenizer.decode
        ids.append(int(token_id))
        head = dec(ids[self.prefix:self.read], skip_special_tokens=True) \
            if self.read > self.prefix else ""
        full = dec(ids[self.prefix:], skip_special_tokens=True)
        if len(full) > len(head) and not full.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(ids)
            return full[len(head):]
        return ""


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's text as it extends the decoded completion (``Detokenizer``)."""
    d = Detokenizer(tokenizer)
    return [d.add(i) for i in ids]


class StopScan:
    """A completion's text token by token, watching for ``stops``: ``cut`` becomes (k, characters
    cut) at the first token k whose text completes a stop string (the characters from the
    earliest stop string on are cut); ``held`` is how many trailing characters could still
    start one (a stream must not show them yet)."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.tokens = list(stops), "", 0
        self.longest = max((len(s) for s in stops), default=0)
        self.cut: Optional[tuple[int, int]] = None

    def add(self, piece: str) -> None:
        start = max(0, len(self.text) - self.longest)
        self.text += piece
        self.tokens += 1
        at = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if at and self.cut is None:
            self.cut = self.tokens, len(self.text) - min(at)

    @property
    def held(self) -> int:
        if self.cut is not None:
            return self.cut[1]
        return max((marker_start(self.text, s) for s in self.stops), default=0)


def stop_cut(tokenizer, ids: Sequence[int], stops: list[str]) -> Optional[tuple[int, int]]:
    """(k, characters cut) for the first token k (1-based count) whose text completes a stop
    string, the characters from the earliest stop string on being cut; None without one."""
    if not stops:
        return None
    scan, d = StopScan(stops), Detokenizer(tokenizer)
    for i in ids:
        scan.add(d.add(i))
        if scan.cut:
            return scan.cut
    return None


def logprobs_body(tokenizer, ids: Sequence[int], logprobs: Sequence[float]) -> dict:
    """OpenAI's ``choices[i].logprobs``: one entry per returned token, its text, bytes and the
    engine's logprob (no alternatives: top_logprobs is refused in ``parse_request``)."""
    texts = token_texts(tokenizer, ids)
    return {"content": [logprob_entry(t, lp) for t, lp in zip(texts, logprobs, strict=True)],
            "refusal": None}


def logprob_entry(text: str, logprob: float) -> dict:
    """One token's entry of OpenAI's ``logprobs.content``."""
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode()),
            "top_logprobs": []}
