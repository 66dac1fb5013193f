"""The calculator's JSON tool-call format (``CalculatorEnv(tool_format="json")``), for a real
instruct model: the Hermes/Qwen convention of a tool schema inside <tools></tools> in the system
prompt and calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Invariants: ``parse_json_action`` never raises on model output; it returns what the first tag
of the text is (an answer, a valid calculator call, a malformed call, or nothing), forgiving of
whitespace and strict about content (module docstring of envs/tool_env.py; docs/envs.md).
``tool_call_text`` (what the system prompt shows and the expert writes) parses back to its
expression: ``parse_json_action(tool_call_text(e)) == ("call", e)``. ``json_system_prompt()`` is
exactly ``CALCULATOR_TASK + hermes_tools_block([CALCULATOR_SCHEMA])``: the text the agent endpoint
(earl_megatron/agents/) renders for the system message CALCULATOR_TASK with that one tool.
"""

from __future__ import annotations

import json
import re

_JSON_TAG = re.compile(r"<(tool_call|answer)>(.*?)</\1>", re.DOTALL)

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: integers and decimals, + - * / // % "
                       "** and parentheses.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string",
                                                     "description": "e.g. 17*23"}},
                       "required": ["expression"]}}}
"""The calculator as a tool schema, the form Qwen's and Hermes' chat templates list tools in."""


def call_text(tool: str, argument: str, value: str) -> str:
    """A call of ``tool`` with its one ``argument`` in the JSON format."""
    call = {"name": tool, "arguments": {argument: value}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def tool_call_text(expression: str) -> str:
    """A calculator call in the JSON format, as the system prompt shows it and the expert writes
    it."""
    return call_text("calculator", "expression", expression)


HERMES_TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user "
                       "query.\n\nYou are provided with function signatures within <tools></tools> "
                       "XML tags:\n<tools>")
HERMES_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function "
                       "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                       '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def hermes_tools_block(tools) -> str:
    """The Hermes/Qwen2.5 system-prompt section listing ``tools`` (OpenAI tool dicts), starting
    with its blank-line separator: exactly what Qwen2.5's template appends to the system message
    when it is given tools, so a template without a tools section shows a model the same text.
    One schema per line, ``json.dumps`` as the templates' ``tojson`` writes it."""
    return HERMES_TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False)
                                         for t in tools) + HERMES_TOOLS_FOOTER


CALCULATOR_TASK = ("You are a helpful assistant. Answer the user's arithmetic question exactly. "
                   "You can call a calculator: reply with only the call, for example\n" +
                   tool_call_text("17*23") + "\nIts result comes back in a tool message. When "
                   "you know the answer, reply with only the number within <answer></answer> XML "
                   "tags, for example <answer>391</answer>.")
"""The calculator's task instruction: the JSON format's system prompt before its tools section.
An agent program that sends it as its system message with ``tools=[CALCULATOR_SCHEMA]`` shows
the model ``json_system_prompt()`` exactly (earl_megatron/agents/chat.py)."""


def json_system_prompt() -> str:
    """The JSON format's system prompt: the task (how to call, how to answer), then the tool
    schema as Hermes/Qwen list it: ``CALCULATOR_TASK + hermes_tools_block([CALCULATOR_SCHEMA])``."""
    return CALCULATOR_TASK + hermes_tools_block([CALCULATOR_SCHEMA])


def parse_json_action(text: str) -> tuple[str, str]:
    """The first action of a turn in the JSON format: ("answer", body), ("call", expression),
    ("malformed", why) for a <tool_call> that is not a valid calculator call, or ("none", why)."""
    return parse_call(text, "calculator", "expression")


def parse_call(text: str, tool: str, argument: str) -> tuple[str, str]:
    """The first action of a turn for an environment whose one tool is ``tool`` with the one
    string ``argument``: ("answer", body), ("call", value), ("malformed", why) or ("none",
    why); never raises."""
    match = _JSON_TAG.search(text)
    opened = text.find("<tool_call>")
    if 0 <= opened and (match is None or opened < match.start()):
        return "malformed", "<tool_call> is not closed with </tool_call>"
    if match is None:
        return "none", "no <tool_call> or <answer> tag"
    if match.group(1) == "answer":
        return "answer", match.group(2).strip()
    try:
        call = json.loads(match.group(2))
    except json.JSONDecodeError as e:
        return "malformed", f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        return "malformed", 'a tool call is an object with exactly "name" and "arguments"'
    if call["name"] != tool:
        return "malformed", f"unknown tool {str(call['name'])[:40]!r}; the only tool is {tool}"
    args = call["arguments"]
    if not isinstance(args, dict) or set(args) != {argument} \
            or not isinstance(args[argument], str):
        return "malformed", f'the arguments are exactly {{"{argument}": "<a string>"}}'
    return "call", args[argument].strip()
