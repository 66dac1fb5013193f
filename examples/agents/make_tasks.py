"""The files ``recipes/smollm2_agent.yaml`` reads: calculator tasks and warm-start traces.

    python -m examples.agents.make_tasks [--out runs/smollm2_agent_data] [--tasks 512]
                                         [--traces 384]        (or: make agent-demo-data)

``tasks.jsonl``: {"question": "What is 37*12?", "answer": 444} per line, the questions of
``CalculatorEnv(tool_format="json")`` on seeds 0.. (two operands up to 99, as
smollm2_tool.yaml). ``warm_start.jsonl``: the calculator expert's JSON-format traces (sft.data,
rollout/trajectories.py) on seeds of their own; their system turn is ``json_system_prompt()``,
the text the endpoint renders for calculator_openai.py's system message and tools
(tests/real/test_real_agent_example.py checks it), so the warm start teaches what the agent shows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from earl_megatron.envs.tool_env import CalculatorEnv
from earl_megatron.rollout.trajectories import expert_trajectories, write_jsonl

ENV_KWARGS = dict(tool_format="json", num_operands=2, max_operand=99, max_tool_calls=1,
                  expert_tool_rate=0.5, mental_accuracy=0.1)
TRACE_SEED = 1_000_000
"""The traces' seeds start here: never a task's question."""


def calculator_tasks(count: int) -> list[dict]:
    env = CalculatorEnv(**ENV_KWARGS)
    out = []
    for seed in range(count):
        question = env.reset(seed)
        out.append({"question": question, "answer": env.answer})
    return out


def warm_start_traces(count: int):
    return expert_trajectories(lambda: CalculatorEnv(**ENV_KWARGS),
                               range(TRACE_SEED, TRACE_SEED + count))


def write(out: Path, tasks: int, traces: int) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    t = out / "tasks.jsonl"
    t.write_text("".join(json.dumps(r) + "\n" for r in calculator_tasks(tasks)))
    return t, write_jsonl(out / "warm_start.jsonl", warm_start_traces(traces))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/smollm2_agent_data")
    ap.add_argument("--tasks", type=int, default=512)
    ap.add_argument("--traces", type=int, default=384)
    a = ap.parse_args()
    for path in write(Path(a.out), a.tasks, a.traces):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
