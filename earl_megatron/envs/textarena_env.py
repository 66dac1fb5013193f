"""TextArena games as an environment: the agent plays one seat, a local opponent of ours the other.

``env=textarena env.kwargs.game=TicTacToe-v0`` (docs/envs.md). The game is TextArena's own
(``textarena.make(game + "-raw")``: its rules, its messages, its rewards, no observation
wrapper), driven turn by turn:

- the system turn is the game's prompt for the agent's seat (TextArena's PROMPT messages);
- each observation is what TextArena told the agent's seat since its last move (the opponent's
  moves, the board, TextArena's own notices), the agent's own move left out (it is the assistant
  turn just before);
- the reward is the game's reward for the agent's seat when the game ends (``env.close()``:
  +1 win, -1 loss, 0 draw in the two-player games), ``info["outcome"]`` win/draw/loss.

Invalid moves follow TextArena's own rule, not the base class's: the game warns and lets the
seat resubmit up to its ``error_allowance`` (1 in TextArena's states), then ends with the
offender's loss. Every warned move counts in ``info["invalid_moves"]``; a game lost that way sets
``info["illegal"]``. ``step`` never raises on model output.

Opponents (TextArena's own agents call hosted LLMs over the network, which a training node need
not have, so none of them is used): ``"random"`` plays uniformly among the moves the game lists
in its last message as quoted brackets (``Available Moves: '[0]', '[4]'``: TicTacToe,
ConnectFour, ...), seeded by the reset seed; a list of strings plays those moves in order (a
scripted line, tests). Single-player games (GuessTheNumber-v0, TowerOfHanoi-v0, ...) need none.

Determinism: TextArena's states seed Python's global ``random`` and some games draw from it as
they play. Every call into the game runs under one lock with the global generator swapped for
this episode's own (its state saved after the call), so an episode is a pure function of (seed,
actions) even with other episodes stepping on other threads, and the process's own ``random``
is left as it was.

Games whose modules download NLTK data at import (Wordle, Hangman, WordLadder, Codenames,
Crosswords, DontSayIt, LetterAuction, WordSearch) fail without internet; pick another game.
"""

from __future__ import annotations

import random
import re
import threading
from typing import Sequence

from earl_megatron.envs.base import Env, StepResult

HELP = "pip install textarena==0.7.4 (the envs extra: pip install -e '.[envs]')"
_QUOTED_MOVE = re.compile(r"'(\[[^\]']*\])'")
_RANDOM_LOCK = threading.Lock()


def _ta():
    try:
        import textarena
    except ImportError as e:
        raise ImportError(f"env=textarena needs the textarena package ({e}); {HELP}") from None
    return textarena


class TextArenaEnv(Env):
    """One TextArena game against a local opponent (module docstring)."""

    name = "textarena"

    def __init__(self, game: str = "TicTacToe-v0", agent_player: int = 0,
                 opponent: str | Sequence[str] = "random", num_players: int = 2):
        super().__init__()   # no invalid_penalty: TextArena's own invalid-move rule decides
        ta = _ta()
        from textarena.envs.registration import ENV_REGISTRY

        if game not in ENV_REGISTRY:
            raise ValueError(f"unknown TextArena game {game!r}; name a registered id such as "
                             "TicTacToe-v0 or ConnectFour-v0 (textarena.envs.registration."
                             "ENV_REGISTRY)")
        if num_players not in (1, 2):
            raise ValueError(f"num_players={num_players}: this environment plays one-player "
                             "games or two-player games against one opponent (1 or 2)")
        if not 0 <= agent_player < num_players:
            raise ValueError(f"agent_player={agent_player}: use a seat in 0..{num_players - 1}")
        if isinstance(opponent, str) and opponent != "random":
            raise ValueError(f"opponent={opponent!r}: use \"random\" or a list of moves to play "
                             "in order (TextArena's own agents call hosted LLMs)")
        self.game, self.agent_player, self.num_players = game, agent_player, num_players
        self.opponent = opponent if isinstance(opponent, str) else tuple(opponent)
        self._ta = ta.make(game + "-raw")
        self._prompt = ""
        self._rng_state = None
        self._opp_rng = random.Random(0)
        self._opp_next = 0
        self._invalid = 0

    # every call into TextArena: under the lock, with this episode's global random state
    def _call(self, fn, *args, **kwargs):
        with _RANDOM_LOCK:
            outer = random.getstate()
            if self._rng_state is not None:
                random.setstate(self._rng_state)
            try:
                return fn(*args, **kwargs)
            finally:
                self._rng_state = random.getstate()
                random.setstate(outer)

    @property
    def system_prompt(self) -> str:
        return self._prompt

    def _render(self, messages) -> str:
        board = _ta().ObservationType.GAME_BOARD
        boards = [i for i, (_, _, kind) in enumerate(messages) if kind == board]
        lines = []
        for i, (sender, text, kind) in enumerate(messages):
            if sender == self.agent_player or kind == board and i != boards[-1]:
                continue   # the agent's own move (its assistant turn) and boards gone stale
            lines.append(text if sender < 0 else f"Player {sender}: {text}")
        return "\n\n".join(lines)

    def _opponent_move(self, messages) -> str:
        if self.opponent == "random":
            for _sender, text, _kind in reversed(messages):
                moves = _QUOTED_MOVE.findall(text)
                if moves:
                    return self._opp_rng.choice(moves)
            raise RuntimeError(f"{self.game} lists no moves as '[...]' for opponent=\"random\" "
                               "to choose from; give env.kwargs.opponent a list of moves")
        if self._opp_next >= len(self.opponent):
            raise RuntimeError(f"the scripted opponent ran out of moves after {self.opponent}; "
                               "give it a longer list")
        self._opp_next += 1
        return self.opponent[self._opp_next - 1]

    def _advance(self) -> tuple[bool, list]:
        """Play the opponent until the agent's seat is to move or the game ends: (done, what
        TextArena told the agent's seat since its last move)."""
        while True:
            player, messages = self._call(self._ta.get_observation)
            if player == self.agent_player:
                return False, list(messages)
            done, _ = self._call(self._ta.step, self._opponent_move(messages))
            if done:
                return True, []

    def _reset(self, seed: int) -> str:
        self._rng_state = None
        self._call(self._ta.reset, num_players=self.num_players, seed=seed)
        self._opp_rng = random.Random(seed)
        self._opp_next = self._invalid = 0
        _, messages = self._advance()
        kinds = _ta().ObservationType
        self._prompt = "\n".join(m for _, m, k in messages if k == kinds.PROMPT).strip()
        return self._render([m for m in messages if m[2] != kinds.PROMPT])

    def _finish(self) -> StepResult:
        rewards, game_info = self._call(self._ta.close)
        mine = game_info.get(self.agent_player, {})
        reward = float((rewards or {}).get(self.agent_player, 0.0))
        outcome = "win" if reward > 0 else "loss" if reward < 0 else "draw"
        reason = str(mine.get("reason", ""))[:200]
        info = {"outcome": outcome, "invalid_moves": self._invalid, "reason": reason}
        if mine.get("invalid_move"):     # the move that lost the game counts too
            self._invalid += 1
            info.update(illegal=True, invalid_moves=self._invalid)
        return StepResult(f"result: {outcome}" + (f" ({reason})" if reason else ""), reward,
                          True, info)

    def _step(self, action: str) -> StepResult:
        done, _ = self._call(self._ta.step, action)
        # TextArena's rule: an invalid move within the seat's error allowance is warned about
        # and the seat moves again (its state counts the errors; a valid move zeroes the count)
        if not done and getattr(self._ta.state, "error_count", 0) > 0:
            self._invalid += 1
            _, messages = self._call(self._ta.get_observation)
            return StepResult(self._render(messages), 0.0, False,
                              {"invalid_moves": self._invalid})
        if not done:
            done, messages = self._advance()
            if not done:
                return StepResult(self._render(messages), 0.0, False,
                                  {"invalid_moves": self._invalid})
        return self._finish()
