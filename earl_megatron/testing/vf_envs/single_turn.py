"""A verifiers SingleTurnEnv: one answer, scored by a Rubric of two weighted functions
(``correct`` 1.0, ``brief`` 0.5); its eval dataset is two other questions."""

import verifiers as vf

from earl_megatron.testing.vf_envs import QUESTIONS, correct, dataset, last_answer

EVAL = [("What is 5+2?", "7"), ("What is 0+1?", "1")]


def brief(completion) -> float:
    """1.0 for an answer of at most 3 characters."""
    return float(0 < len(last_answer(completion)) <= 3)


def load_environment(system_prompt: str = "Answer with the number only.",
                     questions: int = len(QUESTIONS)) -> vf.Environment:
    rubric = vf.Rubric(funcs=[correct, brief], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(dataset=dataset(QUESTIONS[:questions]), eval_dataset=dataset(EVAL),
                            system_prompt=system_prompt, rubric=rubric)
