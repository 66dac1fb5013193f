"""Environments: OpenSpiel games and tool-use environments, registered by name.

``make_env("connect_four", opponent="mcts")``; ``list_envs()`` names them all. See docs/envs.md.
"""

from earl_megatron.envs.base import Env, EnvStateError, StepResult
from earl_megatron.envs.openspiel_games import OpenSpielEnv, connect_four, tic_tac_toe
from earl_megatron.envs.registry import list_envs, make_env, register_env
from earl_megatron.envs.tool_env import CalculatorEnv

register_env("connect_four", connect_four)
register_env("tic_tac_toe", tic_tac_toe)
register_env("calculator", CalculatorEnv)

__all__ = ["Env", "EnvStateError", "StepResult", "OpenSpielEnv", "CalculatorEnv", "list_envs",
           "make_env", "register_env"]
