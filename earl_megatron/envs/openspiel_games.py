"""Connect Four and Tic-Tac-Toe through OpenSpiel, played by the agent against a fixed opponent.

The agent plays one side (``agent_player``: 0 moves first and plays "x", 1 plays "o"); the
opponent plays the other: uniform random, OpenSpiel's MCTS bot (random-rollout evaluator), or a
scripted move list (openings, tests). The opponent draws only from the seed given to ``reset``,
so an episode is a pure function of (seed, agent actions).

Text formats (docs/envs.md shows examples):

- Observation: an optional history line ``moves: 3 3 4`` (every move so far, both sides, as
  action digits), then the board row by row, top row first, ``.`` empty, ``x`` first player,
  ``o`` second player. Connect Four adds a legend row ``0123456`` under the columns; Tic-Tac-Toe
  shows each empty cell as its digit (cells 0-8, row-major) instead of ``.``. When the game ends,
  a last line ``result: win|draw|loss``
  (``result: illegal|unparsable`` after a bad action).
- Action: the first character after stripping whitespace must be a digit; that digit is the move
  (Connect Four: column 0-6, Tic-Tac-Toe: cell 0-8). Everything after it is ignored. No digit
  first -> "unparsable"; a digit that is not a legal move (full column, taken cell, 7-9 in
  Connect Four) -> "illegal". Both end the episode with ``invalid_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import pyspiel

from earl_megatron.envs.base import Env, StepResult

MARKS = ("x", "o")


class Opponent(Protocol):
    def reset(self, game: pyspiel.Game, seed: int) -> None:
        """Start a new episode; all randomness comes from ``seed``."""

    def choose(self, state: pyspiel.State) -> int:
        """A legal action for the player to move in ``state``."""


class RandomOpponent:
    """Uniform over the legal actions, from a RandomState seeded per episode."""

    def reset(self, game, seed):
        self._rng = np.random.RandomState(seed)

    def choose(self, state):
        return int(self._rng.choice(state.legal_actions()))


class MCTSOpponent:
    """OpenSpiel's MCTSBot with a RandomRolloutEvaluator; stronger with more ``simulations``."""

    def __init__(self, simulations: int = 100, uct_c: float = 2.0, rollouts: int = 1):
        if simulations < 1 or rollouts < 1:
            raise ValueError(f"MCTS needs simulations >= 1 and rollouts >= 1, got "
                             f"simulations={simulations}, rollouts={rollouts}")
        self.simulations, self.uct_c, self.rollouts = simulations, uct_c, rollouts

    def reset(self, game, seed):
        from open_spiel.python.algorithms import mcts  # heavy import, only when used
        rng = np.random.RandomState(seed)
        evaluator = mcts.RandomRolloutEvaluator(n_rollouts=self.rollouts, random_state=rng)
        self._bot = mcts.MCTSBot(game, self.uct_c, self.simulations, evaluator, solve=True,
                                 random_state=rng)

    def choose(self, state):
        return int(self._bot.step(state))


class ScriptedOpponent:
    """Plays ``actions`` in order (an opening book, or a known line in tests)."""

    def __init__(self, actions: Sequence[int]):
        self.actions = tuple(int(a) for a in actions)

    def reset(self, game, seed):
        self._next = 0

    def choose(self, state):
        if self._next >= len(self.actions):
            raise RuntimeError(f"scripted opponent ran out of moves after {self.actions}; give "
                               "it a longer script")
        action = self.actions[self._next]
        self._next += 1
        if action not in state.legal_actions():
            raise RuntimeError(f"scripted opponent move {action} is illegal in\n{state}")
        return action


OPPONENTS = ("random", "mcts")


def make_opponent(opponent: str | Opponent, *, mcts_simulations: int = 100,
                  mcts_uct_c: float = 2.0, mcts_rollouts: int = 1) -> Opponent:
    if not isinstance(opponent, str):
        return opponent
    if opponent == "random":
        return RandomOpponent()
    if opponent == "mcts":
        return MCTSOpponent(mcts_simulations, mcts_uct_c, mcts_rollouts)
    raise ValueError(f"unknown opponent {opponent!r}; use one of {OPPONENTS} or pass an object "
                     "with reset(game, seed) and choose(state)")


@dataclass(frozen=True)
class GameSpec:
    name: str
    openspiel_name: str
    action_doc: str
    digit_cells: bool
    """Show empty cells as their action digit (Tic-Tac-Toe) instead of '.' plus a legend row."""


GAMES = {
    "connect_four": GameSpec("connect_four", "connect_four", "a column digit 0-6", False),
    "tic_tac_toe": GameSpec("tic_tac_toe", "tic_tac_toe", "a cell digit 0-8 (row-major)", True),
}


def parse_move(text: str) -> int | None:
    """The move digit at the start of ``text`` (after stripping), or None if there is none."""
    s = text.strip()
    return int(s[0]) if s and s[0] in "0123456789" else None


def render_board(spec: GameSpec, state: pyspiel.State) -> list[str]:
    rows = [r for r in str(state).split("\n") if r]
    if spec.digit_cells:
        width = len(rows[0])
        return ["".join(str(r * width + c) if ch == "." else ch for c, ch in enumerate(row))
                for r, row in enumerate(rows)]
    return rows + ["".join(str(c) for c in range(len(rows[0])))]


class OpenSpielEnv(Env):
    """One OpenSpiel two-player game; the agent is ``agent_player`` and acts by text."""

    def __init__(self, game: str = "connect_four", agent_player: int = 0,
                 opponent: str | Opponent = "random", mcts_simulations: int = 100,
                 mcts_uct_c: float = 2.0, mcts_rollouts: int = 1, invalid_penalty: float = -1.0,
                 show_history: bool = True, system_prompt: str | None = None,
                 legal_move_reward: float = 0.0):
        super().__init__(invalid_penalty)
        # format reward: paid for every legal agent move, so an untrained policy that rarely
        # finishes a game still sees rewards that differ between episodes (0 = off)
        self.legal_move_reward = legal_move_reward
        if game not in GAMES:
            raise ValueError(f"unknown game {game!r}; supported: {sorted(GAMES)}")
        if agent_player not in (0, 1):
            raise ValueError(f"agent_player must be 0 (moves first, x) or 1 (o), got "
                             f"{agent_player}")
        self.spec = GAMES[game]
        self.name = game
        self.game = pyspiel.load_game(self.spec.openspiel_name)
        self.agent_player = agent_player
        self.opponent = make_opponent(opponent, mcts_simulations=mcts_simulations,
                                      mcts_uct_c=mcts_uct_c, mcts_rollouts=mcts_rollouts)
        self.show_history = show_history
        self._system_prompt = system_prompt
        self.state: pyspiel.State | None = None

    @property
    def system_prompt(self) -> str:
        if self._system_prompt is not None:
            return self._system_prompt
        return (f"{self.name.replace('_', ' ')}. you are {MARKS[self.agent_player]}. "
                f"reply with {self.spec.action_doc}.")

    def render(self, outcome: str | None = None) -> str:
        lines = []
        if self.show_history:
            lines.append("moves:" + "".join(f" {a}" for a in self.state.history()))
        lines += render_board(self.spec, self.state)
        if outcome is not None:
            lines.append(f"result: {outcome}")
        return "\n".join(lines)

    def _reset(self, seed: int) -> str:
        self.state = self.game.new_initial_state()
        self.opponent.reset(self.game, seed)
        if self.state.current_player() != self.agent_player:
            self.state.apply_action(self.opponent.choose(self.state))
        return self.render()

    def _outcome(self) -> tuple[float, str]:
        ret = self.state.returns()[self.agent_player]
        return float(ret), "win" if ret > 0 else "loss" if ret < 0 else "draw"

    def _finish(self, bonus: float = 0.0) -> StepResult:
        reward, outcome = self._outcome()
        return StepResult(self.render(outcome), reward + bonus, True, {"outcome": outcome})

    def _step(self, action: str) -> StepResult:
        move = parse_move(action)
        if move is None:
            return self.invalid("unparsable", self.render("unparsable"))
        if move not in self.state.legal_actions():
            return self.invalid("illegal", self.render("illegal"), move=move)
        self.state.apply_action(move)
        bonus = self.legal_move_reward
        if self.state.is_terminal():
            return self._finish(bonus)
        self.state.apply_action(self.opponent.choose(self.state))
        if self.state.is_terminal():
            return self._finish(bonus)
        return StepResult(self.render(), bonus, False, {})


def connect_four(**kwargs) -> OpenSpielEnv:
    return OpenSpielEnv(game="connect_four", **kwargs)


def tic_tac_toe(**kwargs) -> OpenSpielEnv:
    return OpenSpielEnv(game="tic_tac_toe", **kwargs)
