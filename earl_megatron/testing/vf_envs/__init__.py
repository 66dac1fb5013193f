"""Three tiny verifiers environments, one per kind, written with verifiers' public classes and
in-memory datasets (no hub), for env=verifiers' tests (agents/verifiers_glue.py):

    earl_megatron.testing.vf_envs.single_turn   SingleTurnEnv, a weighted Rubric, an eval dataset
    earl_megatron.testing.vf_envs.multi_turn    MultiTurnEnv whose env_response asks once more
    earl_megatron.testing.vf_envs.tool          ToolEnv with one Python tool, ``add``

Each task asks for a sum; every rubric rewards the right number (the last one) in the last
assistant message (1.0) plus a kind's own term, so a score tells which parts of a conversation it saw.
``rescore`` scores recorded messages with an environment's own rubric, as a test's yardstick.
"""

from __future__ import annotations

import asyncio
import re

QUESTIONS = [("What is 2+3?", "5"), ("What is 4+4?", "8"), ("What is 1+6?", "7"),
             ("What is 3+6?", "9")]


def dataset(rows=QUESTIONS):
    from datasets import Dataset
    return Dataset.from_list([{"question": q, "answer": a} for q, a in rows])


def text(message) -> str:
    """A message's text, whether verifiers' model or a plain dict."""
    content = message.get("content") if isinstance(message, dict) else \
        getattr(message, "content", None)
    return content if isinstance(content, str) else ""


def role(message) -> str:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", "")


def last_answer(completion) -> str:
    said = [text(m) for m in completion if role(m) == "assistant"]
    return said[-1].strip() if said else ""


def correct(completion, answer) -> float:
    """1.0 when the last number in the last assistant message is the answer ("3 + 6 = 9" and
    "9" both answer 9), as a math environment parses a reply."""
    numbers = re.findall(r"-?\d+", last_answer(completion))
    return float(bool(numbers) and numbers[-1] == str(answer))


def rescore(env, task: dict, messages: list) -> float:
    """``env``'s rubric score of a conversation recorded as ``messages`` (the task's prompt
    first, then its completion), computed here from verifiers' own State and Rubric."""
    from verifiers.types import State
    from verifiers.utils.message_utils import normalize_messages

    n = len(task["prompt"])
    state = State(input=dict(task))
    state["prompt"] = normalize_messages(list(messages[:n]), field_name="prompt")
    state["completion"] = normalize_messages(list(messages[n:]), field_name="completion")
    state["trajectory"] = [m for m in messages[n:] if role(m) == "assistant"]
    state["timing"] = None
    asyncio.run(env.rubric.score_rollout(state))
    return float(state["reward"])
