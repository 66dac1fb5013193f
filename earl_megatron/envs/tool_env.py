"""A tool-use environment: arithmetic questions the agent may answer with a calculator tool.

Each episode asks for the value of an integer expression generated from the reset seed. Two
action formats (``tool_format``, docs/envs.md), the same rewards:

``"tags"`` (default; the tiny recipe's one-token tags, no system prompt needed): the question is
``compute 37*(12-5)+8`` and each turn the agent emits one of

    <calc>EXPR</calc>     run the calculator; the next observation (a user turn) is
                          <result>VALUE</result> or <error>WHY</error> (division by zero, a bound)
    <answer>N</answer>    final answer; reward 1 if N equals the true value, else 0; done

``"json"`` (for a real instruct model; Hermes/Qwen style): the system prompt (``json_system_
prompt``) gives the calculator's JSON schema inside <tools></tools>, the question is ``What is
37*(12-5)+8?``, and each turn the agent emits one of

    <tool_call>{"name": "calculator", "arguments": {"expression": "EXPR"}}</tool_call>
                          the result comes back as a *tool* message (StepResult.role "tool")
                          holding the plain value (``391``) or ``error: WHY``
    <answer>N</answer>    as above

Parsing is forgiving of whitespace (around the tags' contents, inside the JSON) and strict about
content: valid JSON, an object with exactly "name" and "arguments", name "calculator", arguments
exactly {"expression": <string>}, and arithmetic in it. A call that breaks any of that (or an
unclosed <tool_call>) is a malformed call: the episode ends with ``invalid_penalty`` and
``info["tool_error"]``, ``info["malformed_call"]``, never an exception.

In both formats the first tag in the text counts; text around it is ignored. No tag, a <calc>
whose expression is not plain arithmetic, or an answer that is not a number ends the episode with
``invalid_penalty`` and ``info["unparsable"]``. After ``max_tool_calls`` calculator calls the
next call ends the episode with reward 0 (``info["tool_budget"]``).

``tool`` replaces the calculator (a callable str -> number). A replacement tool runs on a daemon
thread with a wall-clock limit (``tool_timeout_s``, a last-resort guard for code the environment
cannot bound): a tool that raises anything but the calculator's own errors, or does not return in
time, ends THAT episode with ``tool_failure_penalty`` and ``info["tool_error"]`` and
``info["tool_failed"]`` set; the run goes on (a hung thread is abandoned, not killed: Python
cannot kill a thread, so a tool that may hang forever belongs in its own process). The built-in
calculator runs inline with no clock at all: its work is bounded by counts (below), so the same
action gets the same observation and reward on an idle machine and on a loaded one.
``tool_latency_s`` (default 0) makes every calculator call wait that long before it answers, as
a remote tool (a search API, a code sandbox) does: for tests and benchmarks of rollouts whose
time goes to tools (the agent loop steps a turn's environments concurrently,
``rollout.env_concurrency``). The wait changes no observation or reward.

``expert(seed)`` is the scripted teacher of the supervised warm start: the actions of a full
episode from ``reset(seed)``, written in the environment's ``tool_format`` (so a warm start on
its traces teaches that format). With probability ``expert_tool_rate`` it calls the calculator on
the question's expression and answers with the result; otherwise it answers from "mental
arithmetic": the true value with probability ``mental_accuracy``, else the value with one digit
slipped (a plausible, wrong number). Its choices draw from their own stream of the seed, so the
question of a seed does not depend on them.

The calculator never runs ``eval``: ``safe_eval`` parses with ``ast`` and walks only number
literals, unary +/-, and binary + - * / // % **. Its limits count work, never time: at most
``MAX_EXPR_CHARS`` characters and ``MAX_OPERATIONS`` operators (counted before evaluating
anything), integer exponents with ``|e| <= MAX_EXPONENT``, and every intermediate value within
``MAX_MAGNITUDE`` (a power's size checked from logarithms before it is computed, so neither a big
base nor a tiny one with a negative exponent is ever raised). Every operation then takes operands
of at most ~100 bits. Arithmetic Python refuses (an ``OverflowError``, a ``ZeroDivisionError``)
is a ``CalcError``, the agent's mistake, never a failure of the tool.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
import threading
import time
from typing import Callable, Optional

from earl_megatron.envs.base import Env, StepResult
from earl_megatron.envs.tool_calls import json_system_prompt, parse_json_action, tool_call_text

MAX_EXPR_CHARS = 200
MAX_OPERATIONS = 64
"""Unary and binary operators of one expression (the default questions use 2-4)."""
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 30

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARYOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_TAG = re.compile(r"<(calc|answer)>(.*?)</\1>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(\.\d+)?")
TOOL_FORMATS = ("tags", "json")


class CalcUnparsable(ValueError):
    """The expression is not plain arithmetic (syntax error, names, calls, attributes...)."""


class CalcError(ValueError):
    """Plain arithmetic the calculator refuses to finish: division by zero or a bound."""


def safe_eval(expr: str, *, max_exponent: int = MAX_EXPONENT, max_magnitude: int = MAX_MAGNITUDE,
              max_operations: int = MAX_OPERATIONS) -> int | float:
    """The value of an arithmetic expression, without executing any code or reading a clock."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcUnparsable(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcUnparsable(f"not an expression: {type(e).__name__}") from None
    operations = 0
    for node in ast.walk(tree):  # vet the whole tree before evaluating any of it
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            operations += 1
            continue
        if isinstance(node, ast.Expression) or type(node) in _BINOPS or type(node) in _UNARYOPS:
            continue
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            continue
        raise CalcUnparsable(f"{type(node).__name__} is not allowed; only numbers and "
                             "+ - * / // % ** ( )")
    if operations > max_operations:
        raise CalcError(f"more than {max_operations} operations; split the computation")
    log_max = math.log10(max_magnitude)

    def check(value):
        if isinstance(value, float) and not math.isfinite(value) or abs(value) > max_magnitude:
            raise CalcError(f"value exceeds {max_magnitude:.0e}")
        return value

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return check(node.value)
        if isinstance(node, ast.UnaryOp):
            return check(_UNARYOPS[type(node.op)](ev(node.operand)))
        left, right = ev(node.left), ev(node.right)
        if isinstance(node.op, ast.Pow):
            if right != int(right) or abs(right) > max_exponent:
                raise CalcError(f"exponent must be an integer with |e| <= {max_exponent}")
            if left == 0 and right < 0:
                raise CalcError("division by zero")
            right = int(right)
            # log10 |left ** right| bounded before computing it: a big base with a positive
            # exponent or a tiny one with a negative exponent (1e-300 ** -64) is never raised
            if left != 0 and right * math.log10(abs(left)) > log_max:
                raise CalcError(f"value exceeds {max_magnitude:.0e}")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        try:
            return check(_BINOPS[type(node.op)](left, right))
        except (OverflowError, ZeroDivisionError) as e:  # refused arithmetic, not a broken tool
            raise CalcError(f"arithmetic error: {e}") from None

    return ev(tree)


def format_number(value: int | float) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.6g}"
    return str(value)


def make_question(seed: int, num_operands: int = 3, max_operand: int = 99) -> tuple[str, int]:
    """A random integer expression over + - * (maybe one parenthesised pair) and its value."""
    rng = random.Random(seed)
    nums = [str(rng.randint(2, max_operand)) for _ in range(num_operands)]
    ops = [rng.choice("+-*") for _ in range(num_operands - 1)]
    if num_operands >= 3 and rng.random() < 0.5:
        i = rng.randrange(num_operands - 1)
        nums[i], nums[i + 1] = "(" + nums[i], nums[i + 1] + ")"
    expr = nums[0] + "".join(op + n for op, n in zip(ops, nums[1:]))
    return expr, int(safe_eval(expr))


def slipped(value: int, rng: random.Random) -> int:
    """``value`` with one digit replaced by another (never the same number): a mental slip."""
    digits = list(str(abs(value)))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0"
                                                                  and len(digits) > 1)]
    digits[i] = rng.choice(choices)
    return int("".join(digits)) * (-1 if value < 0 else 1)


class ToolFailure(RuntimeError):
    """The tool raised an unexpected error or ran past its deadline."""


def call_with_timeout(fn: Callable[[str], object], arg: str, timeout_s: float):
    """``fn(arg)`` on a daemon thread; its exceptions re-raised here; ToolFailure past the
    deadline (the thread is left to finish on its own)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(arg)
        except BaseException as e:  # noqa: BLE001 - every tool error is the caller's to judge
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="calculator-tool")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ToolFailure(f"tool did not return within {timeout_s}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class CalculatorEnv(Env):
    """Arithmetic questions with a calculator tool; see the module docstring for the format."""

    name = "calculator"

    def __init__(self, num_operands: int = 3, max_operand: int = 99, max_tool_calls: int = 4,
                 invalid_penalty: float = -1.0, system_prompt: str | None = None,
                 tool: Optional[Callable[[str], object]] = None, tool_timeout_s: float = 1.0,
                 tool_failure_penalty: float = -1.0, expert_tool_rate: float = 0.5,
                 mental_accuracy: float = 0.1, tool_format: str = "tags",
                 tool_latency_s: float = 0.0):
        super().__init__(invalid_penalty)
        if not 0.0 <= tool_latency_s < 60.0:
            raise ValueError(f"tool_latency_s={tool_latency_s}: use a delay in [0, 60) seconds "
                             "(0: the calculator answers at once)")
        self.tool_latency_s = float(tool_latency_s)
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format={tool_format!r}: use one of {TOOL_FORMATS} (\"json\" "
                             "for a real instruct model, docs/envs.md)")
        self.tool_format = tool_format
        if num_operands < 2 or max_operand < 2 or max_tool_calls < 0:
            raise ValueError(f"need num_operands >= 2, max_operand >= 2, max_tool_calls >= 0; "
                             f"got {num_operands}, {max_operand}, {max_tool_calls}")
        if not tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s={tool_timeout_s} must be > 0 (seconds)")
        for key, p in (("expert_tool_rate", expert_tool_rate),
                       ("mental_accuracy", mental_accuracy)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{key}={p} is a probability: use a value in [0, 1]")
        self.num_operands, self.max_operand = num_operands, max_operand
        self.max_tool_calls = max_tool_calls
        self._system_prompt = system_prompt
        self.tool = safe_eval if tool is None else tool
        self.tool_timeout_s = float(tool_timeout_s)
        self.tool_failure_penalty = float(tool_failure_penalty)
        self.expert_tool_rate, self.mental_accuracy = expert_tool_rate, mental_accuracy
        self.question, self.answer, self.tool_calls = "", 0, 0

    def expert(self, seed: int) -> list[str]:
        """The scripted teacher's actions for the episode ``reset(seed)`` starts (see above)."""
        expr, value = make_question(seed, self.num_operands, self.max_operand)
        rng = random.Random(f"expert:{seed}")
        if rng.random() < self.expert_tool_rate and self.max_tool_calls >= 1:
            call = tool_call_text(expr) if self.tool_format == "json" else f"<calc>{expr}</calc>"
            return [call, f"<answer>{value}</answer>"]
        guess = value if rng.random() < self.mental_accuracy else slipped(value, rng)
        return [f"<answer>{guess}</answer>"]

    @property
    def system_prompt(self) -> str:
        if self._system_prompt is not None:
            return self._system_prompt
        if self.tool_format == "json":
            return json_system_prompt()
        return "calculator: <calc>expr</calc>. final: <answer>n</answer>."

    def _reset(self, seed: int) -> str:
        expr, self.answer = make_question(seed, self.num_operands, self.max_operand)
        self.question = f"What is {expr}?" if self.tool_format == "json" else f"compute {expr}"
        self.tool_calls = 0
        return self.question

    def _tool_says(self, text: str, error: bool = False) -> str:
        # a tool's observation: tags wrap it; the JSON format's tool message holds it plainly
        if self.tool_format == "json":
            return f"error: {text}" if error else text
        return f"<error>{text}</error>" if error else f"<result>{text}</result>"

    def _parse(self, action: str) -> tuple[str, str]:
        if self.tool_format == "json":
            return parse_json_action(action)
        match = _TAG.search(action)
        if match is None:
            return "none", "no <calc> or <answer> tag"
        return ("call" if match.group(1) == "calc" else "answer"), match.group(2).strip()

    def _step(self, action: str) -> StepResult:
        kind, body = self._parse(action)
        result = self._outcome(kind, body)
        # in the JSON format what answers a tool call (its result, a refusal, a malformed
        # call's error) is a tool message; the verdict on an answer stays a user turn, and so
        # does everything in the tags format
        if self.tool_format == "json" and kind in ("call", "malformed"):
            return StepResult(result.observation, result.reward, result.done, result.info,
                              role="tool")
        return result

    def _outcome(self, kind: str, body: str) -> StepResult:
        if kind == "none":
            return self.invalid("unparsable", self._tool_says(body, error=True),
                                tool_calls=self.tool_calls)
        if kind == "malformed":
            return self.invalid("tool_error", self._tool_says(body, error=True),
                                malformed_call=True, tool_calls=self.tool_calls)
        if kind == "answer":
            if not _NUMBER.fullmatch(body):
                return self.invalid("unparsable", self._tool_says("answer is not a number",
                                                                  error=True),
                                    tool_calls=self.tool_calls)
            correct = abs(float(body) - self.answer) <= 1e-6
            return StepResult(f"<result>{'correct' if correct else 'wrong'}</result>",
                              1.0 if correct else 0.0, True,
                              {"correct": correct, "tool_calls": self.tool_calls})
        if self.tool_calls >= self.max_tool_calls:
            return StepResult(self._tool_says("tool budget spent", error=True), 0.0, True,
                              {"tool_budget": True, "tool_calls": self.tool_calls})
        self.tool_calls += 1
        if self.tool_latency_s:
            time.sleep(self.tool_latency_s)  # a remote tool's round trip; decides nothing
        try:
            # the built-in calculator is bounded by counts and runs inline: no clock decides
            # its reward; a replacement tool gets the thread and its wall-clock guard
            value = safe_eval(body) if self.tool is safe_eval else \
                call_with_timeout(self.tool, body, self.tool_timeout_s)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ToolFailure(f"tool returned {type(value).__name__}, not a number")
        except CalcUnparsable as e:
            if self.tool_format == "json":  # a valid call whose argument is no arithmetic
                return self.invalid("tool_error", self._tool_says(str(e), error=True),
                                    malformed_call=True, tool_calls=self.tool_calls)
            return self.invalid("unparsable", f"<error>{e}</error>", tool_calls=self.tool_calls)
        except CalcError as e:
            return StepResult(self._tool_says(str(e), error=True), 0.0, False,
                              {"tool_error": True, "tool_calls": self.tool_calls})
        except Exception as e:  # noqa: BLE001 - a broken tool ends the episode, not the run
            why = e if isinstance(e, ToolFailure) else f"tool raised {type(e).__name__}"
            return StepResult(self._tool_says(str(why), error=True), self.tool_failure_penalty,
                              True, {"tool_error": True, "tool_failed": True,
                                     "tool_calls": self.tool_calls})
        return StepResult(self._tool_says(format_number(value)), 0.0, False,
                          {"tool_calls": self.tool_calls})


def tool_metrics(rows) -> dict:
    """Per-iteration tool-use metrics from one row per episode:
    (correct, tool calls, tool error, unparsable, sampled turns).

    accuracy: episodes answered right; tool_calls: calculator calls per episode; tool_error_rate:
    episodes with a refused or failed call; unparsable_turn_rate: unparsable turns over all
    sampled turns (an unparsable turn ends its episode, so at most one per episode)."""
    rows = list(rows)
    n, turns = max(len(rows), 1), max(sum(r[4] for r in rows), 1)
    return {"accuracy": sum(bool(r[0]) for r in rows) / n,
            "tool_calls": sum(r[1] for r in rows) / n,
            "tool_error_rate": sum(bool(r[2]) for r in rows) / n,
            "unparsable_turn_rate": sum(bool(r[3]) for r in rows) / turns}
