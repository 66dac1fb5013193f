"""One agent episode's training rows, built token-in/token-out from OpenAI chat requests.

An agent program talks to the endpoint as to any OpenAI server: each request sends the whole
conversation again. ``EpisodeTokens`` keeps the episode as ROWS (token sequences trained under a
loss mask) and answers each request with the ids the engine must see:

    request 1   [system, user]                         -> new row: encode(template text)
    complete    sampled ids appended (mask 1)          -> Reply (content, tool_calls with ids)
    request 2   [system, user, assistant, tool]        -> EXTENDS the row: its tokens + the
                                                          template's text after them (mask 0)
    request 3   [system, user', ...] (history edited)  -> FORKS: a new row from the template

Canonical messages: an assistant message in a request that is one of this episode's replies
(its content and calls, arguments compared as JSON objects; call ids pick between equal replies)
stands for the RAW sampled text (the decoded ids, calls written as the model wrote them), so the
template's text of the conversation is the text the row's tokens already hold.

A request extends a row when (rows are tried newest first, so an agent that alternates between
conversations extends each one; the fork's ``reason`` is the failed check of the newest row
holding a completion): the row has a completion, its tools equal the request's ("tools changed"),
its canonical messages are a prefix of the request's ("history edited at message i", "turn
dropped"), and the template text of the row's messages (no generation prompt) is both what the
row's tokens spell plus what the template closes a turn with, and a prefix of the request's
template text (with generation prompt) ("template re-renders earlier turns (e.g. drops
reasoning)"). The delta is encoded on its own exactly as rollout/tokenizer.render_next_turn
cuts it: after the sampled ids, from the template's end-of-turn token on when the turn was cut
(that token then has mask 0), else from ``fmt.turn_suffix``. A completion recorded on a row that
grew since its prompt was made (concurrent requests) branches: a new row holding the row's
tokens up to that prompt.

Invariants (tests/unit/test_agent_tito.py, with char, BPE ChatML and SmolLM2 tokenizers):
- every row: ``len(token_ids) == len(loss_mask) == len(logprobs) == len(versions)``; mask 1
  exactly on sampled ids, with the engine's logprobs there and 0.0 elsewhere, and the version
  that sampled them there and -1 elsewhere;
- mask-1 ids are the sampled ids as sampled, never decoded and re-encoded (a fork's prompt holds
  earlier replies as context, mask 0, encoded from their raw text);
- ``decode(row.token_ids)`` is the template text of ``row.messages`` (assistant contents = the
  raw sampled text) with ``row.tools`` and no generation prompt, minus what follows the last
  sampled token: the end-of-turn token when that turn was cut, then ``fmt.turn_suffix`` (the
  statement of rollout/agent_loop.py's docstring).
Model output never raises; a bad request raises ChatRequestError (in ``prompt``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

from earl_megatron.agents.chat import ChatRenderer, ChatRequestError, normalize, normalize_tools
from earl_megatron.agents.tool_parsers import Reply


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    """The whole context the engine must continue: the row's tokens + this request's delta."""
    row: int
    """The row the completion will be recorded on (index into the episode's rows)."""
    forked: bool
    """A new row started for a later request (the first request's row is not a fork)."""
    reason: str
    """Why no row was extended ("" when one was)."""
    start: int = field(repr=False)
    """Tokens of the row this prompt builds on; ``ids[start:]`` are the delta (mask 0)."""
    text: str = field(repr=False)
    messages: tuple = field(repr=False)
    tools: tuple = field(repr=False)
    matched: tuple = field(repr=False)
    """(message index, completion index): the request's messages that are this episode's
    replies."""


@dataclass(frozen=True)
class Row:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    turns: int
    tool_calls: int
    malformed: int
    messages: tuple[dict, ...]
    """The canonical conversation the row holds (assistant contents = raw sampled text)."""
    tools: tuple[dict, ...]
    forked_from_reason: str
    finish_reasons: tuple[str, ...]
    """The engine's finish_reason for each sampled turn."""
    versions: tuple[int, ...] = ()
    """The policy version that sampled each token (-1 where the mask is 0): an episode that
    lives across rollout stages (asynchronous RL) holds turns of several versions."""


@dataclass(frozen=True)
class _Completion:
    raw: str
    reply: Reply
    key: tuple
    position: int
    """Its message index in the conversation it answered."""


@dataclass
class _Row:
    # mutable while the episode runs; frozen into a Row by rows()
    tokens: list
    mask: list
    logprobs: list
    text: str
    tools: list
    forked_from_reason: str
    messages: list = field(default_factory=list)
    matched: dict = field(default_factory=dict)
    turn_log: list = field(default_factory=list)  # (end index, tool calls, malformed, finish)
    stopped: bool = False
    rendered: Optional[str] = None  # template text of messages, None when not extendable
    versions: list = field(default_factory=list)

    def append(self, ids: Sequence[int], mask: int, logprobs: Optional[Sequence[float]] = None,
               version: int = -1):
        self.tokens.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend([version if mask else -1] * len(ids))


def _canonical_args(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
    except (json.JSONDecodeError, RecursionError):
        return arguments


def _key(content: Optional[str], calls: Sequence[tuple[str, str]]) -> tuple:
    return ((content or "").strip(), tuple((n, _canonical_args(a)) for n, a in calls))


def _message_key(msg: dict) -> tuple:
    return _key(msg["content"], [(c["function"]["name"], c["function"]["arguments"])
                                 for c in msg.get("tool_calls", ())])


def _tools_key(tools: Sequence[dict]) -> str:
    return json.dumps(list(tools), sort_keys=True)


class EpisodeTokens:
    """The rows of one episode (module docstring). ``id_tag`` goes into every call id."""

    def __init__(self, renderer: ChatRenderer, id_tag: str = ""):
        self.renderer = renderer
        self.id_tag = id_tag
        self._rows: list[_Row] = []
        self._completions: list[_Completion] = []
        self._by_call_id: dict[str, int] = {}
        self._by_key: dict[tuple, list[int]] = {}
        self.forks = 0
        """Rows started for a later request (history edited, tools changed, concurrent ...)."""
        self.calls = 0
        """Completions recorded (one per chat request answered)."""

    # --- requests -------------------------------------------------------------------------------

    def prompt(self, messages, tools=None) -> Prompt:
        msgs, tools = normalize(messages), normalize_tools(tools)
        reason = ""
        for index in reversed(range(len(self._rows))):
            row = self._rows[index]
            if not row.turn_log:
                continue
            got, why = self._extend(row, msgs, tools)
            if got is not None:
                canon, matched, text = got
                delta = self.renderer.encode(text[len(row.text):])
                return Prompt(tuple(row.tokens) + tuple(delta), index, False, "",
                              len(row.tokens), text, tuple(canon), tuple(tools), matched)
            reason = reason or why
        canon, matched = self._canonical(msgs, 0, {})
        text = self.renderer.messages_text(canon, tools, True)
        for index, row in enumerate(self._rows):  # a retried request reuses its pending row
            if not row.turn_log and row.text == text and row.tools == tools:
                return Prompt(tuple(row.tokens), index, bool(row.forked_from_reason),
                              row.forked_from_reason, len(row.tokens), text, tuple(canon),
                              tuple(tools), matched)
        forked = any(row.turn_log for row in self._rows)
        reason = reason if forked else ""
        ids = self.renderer.encode(text)
        self.forks += forked
        self._rows.append(_Row(list(ids), [0] * len(ids), [0.0] * len(ids), text, tools, reason,
                               versions=[-1] * len(ids)))
        return Prompt(tuple(ids), len(self._rows) - 1, forked, reason, len(ids), text,
                      tuple(canon), tuple(tools), matched)

    def _extend(self, row: _Row, msgs: list[dict], tools: list[dict]):
        """((canonical messages, matched, request text), "") when the request extends ``row``,
        else (None, why)."""
        if _tools_key(row.tools) != _tools_key(tools):
            return None, "tools changed"
        n = len(row.messages)
        for i in range(min(n, len(msgs))):
            c = row.matched.get(i)
            same = (msgs[i]["role"] == "assistant"
                    and _message_key(msgs[i]) == self._completions[c].key) if c is not None \
                else msgs[i] == row.messages[i]
            if not same:
                return None, f"history edited at message {i}"
        if len(msgs) < n:
            return None, f"turn dropped: the request has {len(msgs)} messages, the row {n}"
        if row.rendered is None:
            return None, "template re-renders earlier turns (e.g. drops reasoning): the last " \
                         "reply does not render as sampled"
        canon, matched = self._canonical(msgs[n:], n, row.matched)
        text = self.renderer.messages_text(row.messages + canon, tools, True)
        if not text.startswith(row.rendered):
            return None, "template re-renders earlier turns (e.g. drops reasoning) once a " \
                         "turn is appended"
        return (row.messages + canon, matched, text), ""

    def _canonical(self, msgs: list[dict], offset: int, matched: dict):
        """Assistant messages that are this episode's replies -> their raw text; ``offset`` is
        the index of msgs[0] in the conversation, ``matched`` the matches before it."""
        out, found = [], dict(matched)
        for i, msg in enumerate(msgs, start=offset):
            c = self._match(msg, i) if msg["role"] == "assistant" else None
            if c is not None:
                found[i] = c
                msg = {"role": "assistant", "content": self._completions[c].raw}
            out.append(msg)
        return out, tuple(sorted(found.items()))

    def _match(self, msg: dict, position: int) -> Optional[int]:
        key = _message_key(msg)
        ids = {self._by_call_id.get(c.get("id")) for c in msg.get("tool_calls", ())}
        if len(ids) == 1 and None not in ids:
            (c,) = ids
            if self._completions[c].key == key:
                return c
        same = self._by_key.get(key, [])
        here = [c for c in same if self._completions[c].position == position]
        return (here or same or [None])[-1]

    # --- completions ----------------------------------------------------------------------------

    def complete(self, prompt: Prompt, token_ids: Sequence[int], logprobs: Sequence[float],
                 finish_reason: str, stop_text_cut: int = 0, version: int = -1,
                 parse_tools: bool = True) -> Reply:
        """Record the engine's sampled ids for ``prompt`` and parse them into a Reply.

        ``stop_text_cut``: characters the server cut from the end of the decoded text (a client
        stop string); the reply omits them, the row keeps every sampled id. ``version``: the
        policy version that sampled them (the row's ``versions``; -1: not known).
        ``parse_tools`` False (``tool_choice`` "none"): the reply is the text, no call parsed."""
        token_ids, logprobs = list(token_ids), list(logprobs)
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled ids but {len(logprobs)} logprobs; the "
                             "engine must return one logprob per sampled id")
        if not 0 <= prompt.row < len(self._rows):
            raise ValueError(f"prompt.row {prompt.row} is not a row of this episode; complete a "
                             "Prompt that this EpisodeTokens made")
        tok, fmt = self.renderer.tokenizer, self.renderer.fmt
        stopped = bool(token_ids) and token_ids[-1] == fmt.stop_token_ids[0]
        raw = tok.decode(token_ids[:-1] if stopped else token_ids, skip_special_tokens=False)
        text = tok.decode(token_ids, skip_special_tokens=True)
        if not 0 <= stop_text_cut <= len(text):
            raise ValueError(f"stop_text_cut={stop_text_cut} but the reply has {len(text)} "
                             "characters; pass how many characters the stop string cut")
        row = self._rows[prompt.row]
        if len(row.tokens) != prompt.start:
            row = self._branch(prompt)
        row.append(prompt.ids[prompt.start:], 0)
        row.append(token_ids, 1, logprobs, version)
        shown = text[:len(text) - stop_text_cut]
        reply = self.renderer.parser.parse(shown, f"{self.id_tag}{self.calls}") if parse_tools \
            else Reply(shown.strip(), (), 0)
        index = len(self._completions)
        key = _key(reply.content, [(c.name, c.arguments) for c in reply.tool_calls])
        self._completions.append(_Completion(raw, reply, key, len(prompt.messages)))
        self._by_key.setdefault(key, []).append(index)
        self._by_call_id.update({c.id: index for c in reply.tool_calls})
        row.messages = list(prompt.messages) + [{"role": "assistant", "content": raw}]
        row.matched = dict(prompt.matched) | {len(prompt.messages): index}
        row.text = prompt.text + raw + (fmt.end_of_turn if stopped else "")
        row.stopped = stopped
        row.turn_log.append((len(row.tokens), len(reply.tool_calls), reply.malformed,
                             finish_reason))
        try:
            rendered = self.renderer.messages_text(row.messages, row.tools, False)
        except ChatRequestError:
            rendered = None
        closed = prompt.text + raw + fmt.end_of_turn + fmt.turn_suffix
        row.rendered = rendered if rendered == closed else None
        self.calls += 1
        return reply

    def _branch(self, prompt: Prompt) -> _Row:
        """A new row holding ``prompt``'s row up to the prompt (its row grew since)."""
        src, start = self._rows[prompt.row], prompt.start
        new = _Row(src.tokens[:start], src.mask[:start], src.logprobs[:start], prompt.text,
                   list(prompt.tools), f"row {prompt.row} got another completion after this "
                   "prompt was made (concurrent requests)",
                   turn_log=[t for t in src.turn_log if t[0] <= start],
                   versions=src.versions[:start])
        self._rows.append(new)
        self.forks += 1
        return new

    def rows(self) -> list[Row]:
        """The episode's rows that hold at least one sampled turn, in creation order."""
        return [Row(tuple(r.tokens), tuple(r.mask), tuple(r.logprobs), len(r.turn_log),
                    sum(t[1] for t in r.turn_log), sum(t[2] for t in r.turn_log),
                    tuple(r.messages), tuple(r.tools), r.forked_from_reason,
                    tuple(t[3] for t in r.turn_log), tuple(r.versions))
                for r in self._rows if r.turn_log]
