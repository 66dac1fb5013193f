"""OpenAI chat messages to a tokenizer's chat-template text, for the agent endpoint.

``ChatRenderer(tokenizer)`` turns a ``POST /v1/chat/completions`` body's ``messages`` and
``tools`` into the text the tokenizer's chat template defines, in two steps:

    normalize(messages)     OpenAI form -> canonical messages (template-independent):
                            content a string (None -> "", text parts joined with "\\n"),
                            developer -> system, assistant tool_calls checked and kept as
                            {"id"?, "type": "function", "function": {"name", "arguments": JSON}},
                            tool messages keep role "tool" (+ tool_call_id / name when sent)
    messages_text(...)      canonical -> what the template receives -> the template's text:
                            a native-tools template (one that reads ``tools``) gets the tools and
                            the assistant tool_calls as it expects (arguments as objects); any
                            other template gets the calls written into the assistant content in
                            the model's own format (``parser.render_calls``) and the tools as a
                            system-prompt section (``parser.tools_block``, which starts with its
                            own blank-line separator) appended to the first system message, or
                            as a new system message when there is none.

So for the calculator, the system message ``CALCULATOR_TASK`` with ``tools=[CALCULATOR_SCHEMA]``
renders the system turn ``json_system_prompt()`` that the calculator's traces were written with,
on SmolLM2 or the char templates (appended block) and on a Qwen2.5-style native template alike
(its tools section is the same text).

A request the endpoint cannot take raises ``ChatRequestError`` (a ValueError) whose message
names the field and the fix; the server answers 400 with it. Normalising is idempotent:
``normalize(normalize(m)) == normalize(m)``.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from jinja2 import TemplateError

from earl_megatron.agents.tool_parsers import arguments_text, parser_for
from earl_megatron.rollout.tokenizer import _encode, chat_format

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_x9", "description": "probe",
                                                "parameters": {"type": "object",
                                                               "properties": {}}}}


class ChatRequestError(ValueError):
    """A chat request the endpoint cannot take; the message names the field and the fix."""


def _content(msg: dict, i: int) -> Optional[str]:
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ChatRequestError(f"messages[{i}].content[{k}]: only text parts "
                                       '{"type": "text", "text": "..."} are supported; send '
                                       "the content as a string or as text parts")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatRequestError(f"messages[{i}].content is a {type(content).__name__}; send a "
                           "string, null, or a list of text parts")


def _tool_calls(msg: dict, i: int) -> list[dict]:
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ChatRequestError(f"messages[{i}].tool_calls must be a list of "
                               '{"type": "function", "function": {"name", "arguments"}}')
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatRequestError(f"messages[{i}].tool_calls[{k}] needs "
                                   '{"type": "function", "function": {"name": "...", '
                                   '"arguments": "{...}"}}')
        try:
            args = arguments_text(fn.get("arguments", "{}"))
        except ValueError as e:
            raise ChatRequestError(f"messages[{i}].tool_calls[{k}].function.arguments: {e}") \
                from None
        one = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            one = {"id": call["id"], **one}
        out.append(one)
    return out


def normalize(messages) -> list[dict]:
    """Canonical messages (module docstring); ChatRequestError on a request that is not one."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list of message objects "
                               '({"role": "user", "content": "..."})')
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatRequestError(f"messages[{i}] is a {type(msg).__name__}; each message is an "
                                   'object {"role": ..., "content": ...}')
        role = ROLES.get(msg.get("role"))
        if role is None:
            raise ChatRequestError(f"messages[{i}].role is {msg.get('role')!r}; use one of "
                                   f"{sorted(ROLES)}")
        content = _content(msg, i)
        calls = _tool_calls(msg, i) if role == "assistant" else []
        if content is None and role != "assistant":
            raise ChatRequestError(f"messages[{i}].content is missing; a {role} message needs "
                                   "content (a string or a list of text parts)")
        one = {"role": role, "content": content or ""}
        if calls:
            one["tool_calls"] = calls
        if role == "tool":
            one.update({k: msg[k] for k in ("tool_call_id", "name") if isinstance(msg.get(k), str)})
        out.append(one)
    return out


def normalize_tools(tools) -> list[dict]:
    """The request's tools as a list ([] for none); ChatRequestError when malformed."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list of "
                               '{"type": "function", "function": {"name", "parameters"}}')
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError(f"tools[{k}] needs "
                                   '{"type": "function", "function": {"name": "...", ...}}')
    return list(tools)


class ChatRenderer:
    """One tokenizer's chat template, end-of-turn format and tool-call parser."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.fmt = chat_format(tokenizer)
        self.parser = parser_for(tokenizer)
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
        self.native_tools = self._apply(probe, None, False) != self._apply(probe, [_PROBE_TOOL],
                                                                           False)
        """Whether the template reads ``tools`` (renders differently with a tool)."""

    def _apply(self, messages: list[dict], tools: Optional[list], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=generation_prompt)
        except TemplateError as e:
            raise ChatRequestError(f"the chat template refuses these messages ({e}); send only "
                                   "roles and orders the model's template accepts") from None

    def template_messages(self, messages: list[dict], tools: Sequence[dict]) -> list[dict]:
        """Canonical messages as this template receives them (module docstring)."""
        out = []
        for msg in messages:
            calls = msg.get("tool_calls")
            if msg["role"] == "assistant" and calls:
                if self.native_tools:
                    msg = {**msg, "tool_calls": [
                        {**c, "function": {"name": c["function"]["name"],
                                           "arguments": json.loads(c["function"]["arguments"])}}
                        for c in calls]}
                else:
                    text = self.parser.render_calls(msg["content"], [
                        (c["function"]["name"], c["function"]["arguments"]) for c in calls])
                    msg = {"role": "assistant", "content": text}
            out.append(msg)
        if tools and not self.native_tools:
            block = self.parser.tools_block(tools)
            if out and out[0]["role"] == "system":
                content = out[0]["content"]
                out[0] = {**out[0], "content": content + block if content else block.lstrip()}
            else:
                out.insert(0, {"role": "system", "content": block.lstrip()})
        return out

    def messages_text(self, messages, tools: Optional[list], generation_prompt: bool) -> str:
        """The template's text of OpenAI (or canonical) ``messages`` with ``tools``."""
        tools = normalize_tools(tools)
        msgs = self.template_messages(normalize(messages), tools)
        return self._apply(msgs, tools if self.native_tools else None, generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of template text, adding nothing (the text holds BOS and role tokens)."""
        return _encode(self.tokenizer, text)
