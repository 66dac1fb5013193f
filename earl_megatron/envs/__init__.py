"""Environments: OpenSpiel games, tool-use environments, reasoning-gym tasks and TextArena games,
registered by name.

``make_env("connect_four", opponent="mcts")``; ``list_envs()`` names them all. See docs/envs.md.
"""

from earl_megatron.envs.base import Env, EnvStateError, StepResult
from earl_megatron.envs.openspiel_games import OpenSpielEnv, connect_four, tic_tac_toe
from earl_megatron.envs.registry import list_envs, make_env, register_env
from earl_megatron.envs.reasoning_gym_env import ReasoningGymEnv
from earl_megatron.envs.textarena_env import TextArenaEnv
from earl_megatron.envs.tool_env import CalculatorEnv

register_env("connect_four", connect_four)
register_env("tic_tac_toe", tic_tac_toe)
register_env("calculator", CalculatorEnv)
register_env("reasoning_gym", ReasoningGymEnv)   # the envs extra: reasoning-gym
register_env("textarena", TextArenaEnv)          # the envs extra: textarena

__all__ = ["Env", "EnvStateError", "StepResult", "OpenSpielEnv", "CalculatorEnv", "list_envs",
           "make_env", "register_env"]
