"""A verifiers MultiTurnEnv of two turns: after the first answer its env_response (scripted)
asks "Are you sure?"; the rubric rewards the last answer (``correct``) and 0.25 for keeping the
first one (``kept``)."""

import verifiers as vf

from earl_megatron.testing.vf_envs import QUESTIONS, correct, dataset, role, text

ASK = "Are you sure? Answer again."


def kept(completion) -> float:
    said = [text(m).strip() for m in completion if role(m) == "assistant"]
    return float(len(said) == 2 and said[0] == said[1])


class AskTwice(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": ASK}]


def load_environment(max_turns: int = 2, questions: int = len(QUESTIONS)) -> vf.Environment:
    return AskTwice(dataset=dataset(QUESTIONS[:questions]), max_turns=max_turns,
                    system_prompt="Answer with the number only.",
                    rubric=vf.Rubric(funcs=[correct, kept], weights=[1.0, 0.25]))
