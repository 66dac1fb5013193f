"""Tool calls in a model's own text: parse a sampled reply, write a client's calls back.

An OpenAI-compatible endpoint hands the model's reply to the client as ``content`` plus
``tool_calls``, and gets assistant messages back in that form. Each model family writes calls
its own way, so there is one parser per family, chosen by the chat template (``parser_for``):

    hermes       Hermes / Qwen2.5 / ChatML (SmolLM2) and the project's char templates:
                 free text and any number of blocks
                 <tool_call>\\n{"name": "calculator", "arguments": {...}}\\n</tool_call>
    llama3_json  Llama 3.x: the whole reply is one call (or several joined by ";")
                 {"name": "calculator", "parameters": {"expression": "17*23"}}
                 optionally after <|python_tag|>

Each parser has ``parse(text, id_prefix) -> Reply``, ``render_calls(content, calls) -> str``
(an assistant message's text in the family's format, for an assistant message the endpoint did
not sample itself) and ``tools_block(tools) -> str`` (the tool schemas as a system-prompt
section, for templates without a tools section).

Invariants (tests/unit/test_agent_tito.py):
- ``parse`` never raises on model output. A block that is not a valid call (not JSON, no string
  "name", arguments not an object, an unclosed tag) is counted in ``Reply.malformed`` and kept
  in ``Reply.content`` as written, so nothing the model said is lost.
- Call ids are deterministic: the k-th call of a reply is ``f"call_{id_prefix}_{k}"``.
- ``parse(render_calls(content, calls))`` gives back the content (stripped; None when empty and
  there are calls) and the calls, arguments as ``json.dumps`` of the parsed object.
- The hermes tools block is envs/tool_calls.hermes_tools_block: the calculator's system prompt
  is ``CALCULATOR_TASK + HermesParser().tools_block([CALCULATOR_SCHEMA])``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from earl_megatron.envs.tool_calls import hermes_tools_block


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as JSON text, as OpenAI sends it."""


@dataclass(frozen=True)
class Reply:
    content: Optional[str]
    """The text outside valid call blocks, stripped; None when empty and there are calls."""
    tool_calls: tuple[ToolCall, ...]
    malformed: int
    """Call blocks that were not valid calls (they stay in ``content``)."""


def arguments_text(arguments) -> str:
    """Canonical JSON text of a call's arguments given as an object or as JSON text; ValueError
    (naming the fix) when it is neither."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments {arguments[:60]!r} are not JSON ({e.msg}); "
                             "send the arguments object as JSON text") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got "
                         f"{type(arguments).__name__}")
    return json.dumps(arguments, ensure_ascii=False)


def _reply(pieces: list[str], calls: list[tuple[str, dict]], malformed: int,
           id_prefix: str) -> Reply:
    content = "".join(pieces).strip()
    tool_calls = tuple(ToolCall(f"call_{id_prefix}_{k}", name, json.dumps(args, ensure_ascii=False))
                       for k, (name, args) in enumerate(calls))
    return Reply(content if content or not tool_calls else None, tool_calls, malformed)


def marker_start(text: str, marker: str) -> int:
    """The longest end of ``text`` that begins ``marker`` (a marker that may be coming)."""
    return max((n for n in range(min(len(marker) - 1, len(text)), 0, -1)
                if text.endswith(marker[:n])), default=0)


def _call(obj, args_key: str) -> Optional[tuple[str, dict]]:
    """(name, arguments) of a decoded call object, or None when it is not a valid call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments"))
    return (obj["name"], args) if isinstance(args, dict) else None


class HermesParser:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks in free text."""

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def parse(self, text: str, id_prefix: str) -> Reply:
        pieces, calls, malformed, at = [], [], 0, 0
        for m in self._BLOCK.finditer(text):
            pieces.append(text[at:m.start()])
            at = m.end()
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except (json.JSONDecodeError, RecursionError):
                call = None
            if call is None:
                malformed += 1
                pieces.append(m.group(0))
            else:
                calls.append(call)
        rest = text[at:]
        malformed += rest.count(self._OPEN)  # unclosed blocks (a turn cut by its budget)
        pieces.append(rest)
        return _reply(pieces, calls, malformed, id_prefix)

    def content_prefix(self, text: str) -> int:
        """Characters of a completion so far that stay content however it goes on: those
        before a call block could begin (a stream shows no more)."""
        at = text.find(self._OPEN)
        return at if at >= 0 else len(text) - marker_start(text, self._OPEN)

    def render_calls(self, content: Optional[str], calls: Sequence[tuple[str, str]]) -> str:
        """Content then one block per call, newline-separated, as Qwen2.5's template writes an
        assistant message with ``tool_calls``."""
        blocks = [f"<tool_call>\n{self._call_json(name, args)}\n</tool_call>"
                  for name, args in calls]
        return "\n".join(([content] if content else []) + blocks)

    @staticmethod
    def _call_json(name: str, arguments: str) -> str:
        return ('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
                + arguments_text(arguments) + "}")

    def tools_block(self, tools: Sequence[dict]) -> str:
        return hermes_tools_block(tools)


class Llama3JsonParser:
    """Llama 3.x JSON calls: the reply is ``{"name": ..., "parameters": {...}}`` (several joined
    by ";"), optionally after ``<|python_tag|>``; text before the tag is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, id_prefix: str) -> Reply:
        tagged = self.TAG in text
        head, _, body = text.partition(self.TAG) if tagged else ("", "", text)
        if not tagged and not body.lstrip().startswith("{"):
            return _reply([text], [], 0, id_prefix)  # plain text, no call attempted
        calls = self._calls(body)
        if calls is None:
            return _reply([text], [], 1, id_prefix)
        return _reply([head], calls, 0, id_prefix)

    def content_prefix(self, text: str) -> int:
        """As HermesParser's: nothing while the reply could be a bare JSON call, else the text
        before the tag."""
        if not text.strip() or text.lstrip().startswith("{"):
            return 0
        at = text.find(self.TAG)
        return at if at >= 0 else len(text) - marker_start(text, self.TAG)

    @staticmethod
    def _calls(body: str) -> Optional[list[tuple[str, dict]]]:
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(body) and body[at].isspace():
                at += 1
            try:
                obj, at = decoder.raw_decode(body, at)
            except (json.JSONDecodeError, RecursionError):
                return None
            call = _call(obj, "parameters")
            if call is None:
                return None
            calls.append(call)
            rest = body[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            at = len(body) - len(rest) + 1

    def render_calls(self, content: Optional[str], calls: Sequence[tuple[str, str]]) -> str:
        """The calls as Llama 3.1's template writes them; content, if any, before the tag."""
        body = "; ".join('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '
                         + arguments_text(args) + "}" for name, args in calls)
        if not calls:
            return content or ""
        return f"{content}{self.TAG}{body}" if content else body

    def tools_block(self, tools: Sequence[dict]) -> str:
        schemas = "\n\n".join(json.dumps(t, ensure_ascii=False, indent=4) for t in tools)
        return ("\n\nYou have access to the following functions. To call a function, respond "
                "with only a JSON object in the format {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}. Do not use variables.\n\n" + schemas)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for(tokenizer):
    """The parser for a tokenizer's chat template: Llama-3 style templates (``<|eot_id|>``,
    ``<|python_tag|>``) get llama3_json; everything else (Qwen, Hermes, ChatML, SmolLM2, the
    char templates, unknown ones) gets hermes."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: any of them decides the family
        template = "\n".join(str(t) for t in template.values())
    if "<|eot_id|>" in template or "<|python_tag|>" in template:
        return Llama3JsonParser()
    return HermesParser()
