"""A verifiers EnvGroup of the three kinds (single-turn, multi-turn, tool): verifiers routes each
dataset row to its own environment (the row's ``task`` column) and scores it with that one's
rubric (its ``info.env_id``), so one ``env=verifiers`` run plays all three. ``questions``: the first N questions of
each kind (rows in order: the single-turn ones, then multi-turn, then tool), so that
consecutive episode seeds cycle through the kinds when N is 1."""

import verifiers as vf

from earl_megatron.testing.vf_envs import QUESTIONS, multi_turn, single_turn, tool

KINDS = ("single_turn", "multi_turn", "tool")


def load_environment(questions: int = len(QUESTIONS)) -> vf.Environment:
    envs = [single_turn.load_environment(questions=questions),
            multi_turn.load_environment(max_turns=2, questions=questions),
            tool.load_environment(max_turns=3, questions=questions)]
    return vf.EnvGroup(envs=envs, env_names=list(KINDS))
