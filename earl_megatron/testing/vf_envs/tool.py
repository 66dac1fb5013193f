"""A verifiers ToolEnv with one Python tool, ``add``; the rubric rewards the right final
answer (``correct``) and 0.5 for having called the tool (``used_add``)."""

import verifiers as vf

from earl_megatron.testing.vf_envs import QUESTIONS, correct, dataset, role


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        Their sum.
    """
    return a + b


def used_add(completion) -> float:
    return float(any(role(m) == "tool" for m in completion))


def load_environment(max_turns: int = 3, questions: int = len(QUESTIONS)) -> vf.Environment:
    return vf.ToolEnv(dataset=dataset(QUESTIONS[:questions]), tools=[add], max_turns=max_turns,
                      system_prompt="Use the add tool, then answer with the number only.",
                      rubric=vf.Rubric(funcs=[correct, used_add], weights=[1.0, 0.5]))
