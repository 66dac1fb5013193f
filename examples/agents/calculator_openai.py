"""The calculator task as an agent program: plain ``openai`` client code and a Python tool.

    earl train --nproc-per-node 2 --config-name smollm2_agent        (from the repository root)

The trainer calls ``agent(task, base_url, api_key, model)`` once per episode with a row of the
tasks file ({"question": "What is 37*12?", "answer": 444}; ``make agent-demo-data`` writes it)
and trains on what the model said through ``base_url``. The system message CALCULATOR_TASK with
``tools=[CALCULATOR_SCHEMA]`` reaches SmolLM2 as the calculator's JSON-format system prompt, the
one the warm-start traces were written with.
"""

import json
import re

from openai import OpenAI

from earl_megatron.envs.tool_calls import CALCULATOR_SCHEMA, CALCULATOR_TASK
from earl_megatron.envs.tool_env import format_number, safe_eval

MAX_CALLS = 3


def calculator(expression: str) -> str:
    try:
        return format_number(safe_eval(expression))
    except ValueError as e:
        return f"error: {e}"


def agent(task: dict, base_url: str, api_key: str, model: str) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "system", "content": CALCULATOR_TASK},
                {"role": "user", "content": task["question"]}]
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(model=model, messages=messages,
                                               tools=[CALCULATOR_SCHEMA]).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(str(expression))})
    answer = re.search(r"<answer>\s*(-?\d+(?:\.\d+)?)\s*</answer>", reply.content or "")
    return float(answer is not None and float(answer.group(1)) == task["answer"])
