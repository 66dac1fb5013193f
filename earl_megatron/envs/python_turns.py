"""The turns of a Python tool in an environment whose episode ends with an answer: the model may
run programs before it answers (envs/reasoning_gym_env.py ``tool=python``, docs/envs.md).

Each turn's first tag decides (the JSON tool-call format of envs/tool_calls.py, Hermes/Qwen):

    <tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}</tool_call>
        the program runs in envs/python_tool.py's sandbox (its own process, CPU / memory /
        output limits, no network); what it prints (or why it failed, ``info["tool_error"]``)
        comes back as a tool message and the episode goes on
    <answer>...</answer>, or no tag
        the environment scores the reply as it does without the tool (``step`` returns None)

A malformed call (not JSON, another tool, other arguments, an unclosed tag) ends the episode
with the environment's ``invalid_penalty`` and ``info["tool_error"]``, ``info["malformed_call"]``;
a call past ``max_tool_calls`` ends it with reward 0 and ``info["tool_budget"]``. Every step's
``info`` counts ``tool_calls``.

``expert_program(entry)``: the warm start's teacher's program for a reasoning-gym entry, where
this module knows one that prints exactly the gold answer (arithmetic: the task's expression,
rounded where a division makes it a float; letter counting: a count over the words); None
elsewhere (the teacher answers directly).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from earl_megatron.envs.base import StepResult
from earl_megatron.envs.python_tool import PYTHON_SCHEMA, PythonLimits, PythonSandbox
from earl_megatron.envs.tool_calls import call_text, hermes_tools_block, parse_call

TOOL_TASK = ("\n\nYou can run Python programs: reply with only the call, for example\n" +
             call_text("python", "code", "print(17 * 23)") +
             "\nWhat the program prints comes back in a tool message. Then give your answer.")
"""Appended to the task's system prompt, before the tool's schema."""

ARITHMETIC = ("basic_arithmetic", "chain_sum")


class PythonTurns:
    """The tool's state for one environment (module docstring); ``tool=None``: no tool, every
    method a no-op."""

    def __init__(self, tool: Optional[str], max_tool_calls: int = 4,
                 python: Optional[Mapping[str, Any]] = None):
        if tool not in (None, "python"):
            raise ValueError(f"env.kwargs.tool={tool!r}: the one tool is python (null: answer "
                             "in one turn)")
        if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or \
                max_tool_calls < 1:
            raise ValueError(f"env.kwargs.max_tool_calls={max_tool_calls!r} must be an integer "
                             ">= 1")
        known = {f.name for f in dataclasses.fields(PythonLimits)}
        unknown = sorted(set(python or {}) - known)
        if unknown:
            raise ValueError(f"env.kwargs.python has unknown limit(s) {unknown}; the limits: "
                             f"{sorted(known)} (envs/python_tool.py)")
        self.enabled, self.max_tool_calls = tool == "python", max_tool_calls
        self.sandbox = PythonSandbox(PythonLimits(**dict(python or {})))
        if self.enabled:
            self.sandbox.check_isolation()
        self.calls = 0

    def prompt(self, task_prompt: str) -> str:
        """The system prompt: the task's, then (with the tool) how to call it and its schema."""
        if not self.enabled:
            return task_prompt
        return task_prompt + TOOL_TASK + hermes_tools_block([PYTHON_SCHEMA])

    def reset(self) -> None:
        self.calls = 0

    def counts(self) -> dict:
        return {"tool_calls": self.calls} if self.enabled else {}

    def step(self, action: str, invalid: Callable[..., StepResult]) -> Optional[StepResult]:
        """The turn's result when ``action`` calls the tool (or calls it wrong); None when the
        environment scores it. ``invalid``: the environment's ``invalid``."""
        if not self.enabled:
            return None
        kind, body = parse_call(action, "python", "code")
        if kind in ("answer", "none"):
            return None
        if kind == "malformed":
            return dataclasses.replace(invalid("tool_error", f"error: {body}",
                                               malformed_call=True, tool_calls=self.calls),
                                       role="tool")
        if self.calls >= self.max_tool_calls:
            return StepResult("error: tool budget spent", 0.0, True,
                              {"tool_budget": True, "tool_calls": self.calls}, role="tool")
        self.calls += 1
        result = self.sandbox.run(body)
        info = {"tool_calls": self.calls, **({} if result.ok else {"tool_error": True})}
        return StepResult(result.output or "(no output)", 0.0, False, info, role="tool")

    def expert(self, entry: Mapping[str, Any]) -> list[str]:
        """The teacher's tool call for ``entry`` (none without the tool or a known program)."""
        program = expert_program(entry) if self.enabled else None
        return [call_text("python", "code", program)] if program else []


def expert_program(entry: Mapping[str, Any]) -> Optional[str]:
    """A program that prints exactly ``entry["answer"]`` (module docstring), or None."""
    from earl_megatron.envs.tool_env import CalcError, safe_eval

    meta, gold = entry.get("metadata", {}), str(entry.get("answer"))
    task = meta.get("source_dataset")
    if task in ARITHMETIC and isinstance(meta.get("expression"), str):
        expr = meta["expression"]
        try:   # the calculator's evaluation, never eval: the program must print the gold answer
            value = safe_eval(expr)
        except CalcError:
            return None
        if str(value) == gold:
            return f"print({expr})"
        # a division whose result is whole: Python prints -204.0 where the answer is -204
        return f"print(round({expr}))" if str(round(value)) == gold else None
    if task == "letter_counting" and isinstance(meta.get("span"), list):
        letter, words = str(meta.get("target_letter", "")), [str(w) for w in meta["span"]]
        count = sum(w.lower().count(letter) for w in words)
        return (f"words = {words!r}\nprint(sum(w.lower().count({letter!r}) for w in words))"
                if len(letter) == 1 and str(count) == gold else None)
    return None
