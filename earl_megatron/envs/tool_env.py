"""A tool-use environment: arithmetic questions the agent may answer with a calculator tool.

Each episode asks for the value of an integer expression generated from the reset seed (e.g.
``compute 37*(12-5)+8``). Each turn the agent emits exactly one of (docs/envs.md):

    <calc>EXPR</calc>     run the calculator; the next observation is <result>VALUE</result>
                          or <error>WHY</error> (division by zero, a bound exceeded)
    <answer>N</answer>    final answer; reward 1 if N equals the true value, else 0; done

The first such tag in the text counts; text around it is ignored. No tag, a tag whose expression
is not plain arithmetic, or an answer that is not a number ends the episode with
``invalid_penalty`` and ``info["unparsable"]``. After ``max_tool_calls`` calculator calls the
next call ends the episode with reward 0 (``info["tool_budget"]``).

The calculator never runs ``eval``: ``safe_eval`` parses with ``ast`` and walks only number
literals, unary +/-, and binary + - * / // % **. Bounds make every operation cheap: at most
``MAX_EXPR_CHARS`` characters, integer exponents with ``|e| <= MAX_EXPONENT``, every
intermediate value within ``MAX_MAGNITUDE``, and a wall-clock deadline checked at every node.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
import time

from earl_megatron.envs.base import Env, StepResult

MAX_EXPR_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 30
TIME_LIMIT_S = 0.05

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARYOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_TAG = re.compile(r"<(calc|answer)>(.*?)</\1>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


class CalcUnparsable(ValueError):
    """The expression is not plain arithmetic (syntax error, names, calls, attributes...)."""


class CalcError(ValueError):
    """Plain arithmetic the calculator refuses to finish: division by zero or a bound."""


def safe_eval(expr: str, *, max_exponent: int = MAX_EXPONENT, max_magnitude: int = MAX_MAGNITUDE,
              time_limit_s: float = TIME_LIMIT_S) -> int | float:
    """The value of an arithmetic expression, without executing any code."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcUnparsable(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalcUnparsable(f"not an expression: {type(e).__name__}") from None
    for node in ast.walk(tree):  # vet the whole tree before evaluating any of it
        if isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp)) or \
                type(node) in _BINOPS or type(node) in _UNARYOPS:
            continue
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            continue
        raise CalcUnparsable(f"{type(node).__name__} is not allowed; only numbers and "
                             "+ - * / // % ** ( )")
    deadline = time.monotonic() + time_limit_s

    def check(value):
        if isinstance(value, float) and not math.isfinite(value) or abs(value) > max_magnitude:
            raise CalcError(f"value exceeds {max_magnitude:.0e}")
        return value

    def ev(node):
        if time.monotonic() > deadline:
            raise CalcError(f"time limit {time_limit_s}s exceeded")
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
            # |left|**|right| bounded before computing it, so a big base costs nothing either
            if abs(left) > 1 and abs(right) * math.log10(abs(left)) > math.log10(max_magnitude):
                raise CalcError(f"value exceeds {max_magnitude:.0e}")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        return check(_BINOPS[type(node.op)](left, right))

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


class CalculatorEnv(Env):
    """Arithmetic questions with a calculator tool; see the module docstring for the format."""

    name = "calculator"

    def __init__(self, num_operands: int = 3, max_operand: int = 99, max_tool_calls: int = 4,
                 invalid_penalty: float = -1.0, system_prompt: str | None = None):
        super().__init__(invalid_penalty)
        if num_operands < 2 or max_operand < 2 or max_tool_calls < 0:
            raise ValueError(f"need num_operands >= 2, max_operand >= 2, max_tool_calls >= 0; "
                             f"got {num_operands}, {max_operand}, {max_tool_calls}")
        self.num_operands, self.max_operand = num_operands, max_operand
        self.max_tool_calls = max_tool_calls
        self._system_prompt = system_prompt
        self.question, self.answer, self.tool_calls = "", 0, 0

    @property
    def system_prompt(self) -> str:
        if self._system_prompt is not None:
            return self._system_prompt
        return "calculator: <calc>expr</calc>. final: <answer>n</answer>."

    def _reset(self, seed: int) -> str:
        expr, self.answer = make_question(seed, self.num_operands, self.max_operand)
        self.question, self.tool_calls = f"compute {expr}", 0
        return self.question

    def _step(self, action: str) -> StepResult:
        match = _TAG.search(action)
        if match is None:
            return self.invalid("unparsable", "<error>no <calc> or <answer> tag</error>",
                                tool_calls=self.tool_calls)
        tag, body = match.group(1), match.group(2).strip()
        if tag == "answer":
            if not _NUMBER.fullmatch(body):
                return self.invalid("unparsable", "<error>answer is not a number</error>",
                                    tool_calls=self.tool_calls)
            correct = abs(float(body) - self.answer) <= 1e-6
            return StepResult(f"<result>{'correct' if correct else 'wrong'}</result>",
                              1.0 if correct else 0.0, True,
                              {"correct": correct, "tool_calls": self.tool_calls})
        if self.tool_calls >= self.max_tool_calls:
            return StepResult("<error>tool budget spent</error>", 0.0, True,
                              {"tool_budget": True, "tool_calls": self.tool_calls})
        self.tool_calls += 1
        try:
            value = safe_eval(body)
        except CalcUnparsable as e:
            return self.invalid("unparsable", f"<error>{e}</error>", tool_calls=self.tool_calls)
        except CalcError as e:
            return StepResult(f"<error>{e}</error>", 0.0, False,
                              {"tool_error": True, "tool_calls": self.tool_calls})
        return StepResult(f"<result>{format_number(value)}</result>", 0.0, False,
                          {"tool_calls": self.tool_calls})
