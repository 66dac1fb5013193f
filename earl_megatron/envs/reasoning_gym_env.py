"""reasoning-gym tasks as an environment: one seeded question, one answer, reasoning-gym's score.

``env=reasoning_gym env.kwargs.tasks=[basic_arithmetic,leg_counting] env.kwargs.size=N``
(docs/envs.md). The tasks come from reasoning-gym's own generators through its
``CompositeDataset`` (one task or several, equal weights; ``config`` passes each generator its
settings), and the reward is that dataset's own ``score_answer`` of the answer reasoning-gym's
own ``extract_answer`` finds in the reply (the last ``<answer>...</answer>``): the numbers this
environment pays are the library's, never a re-implementation. Single-turn: the reply ends the
episode.

Which task a seed plays (the episode seed the trainer gives ``reset``, earl_megatron/seeds.py):

- training seeds (RL iterations, below ``EVAL_BASE``; the warm start's, from ``EXPERT_BASE``)
  play task ``seed % size`` of the training pool, ``CompositeDataset(seed=seed_kwarg,
  size=size)``: a fixed set of ``size`` tasks, as a dataset of that many rows would be;
- evaluation seeds (``EVAL_BASE <= seed < EXPERT_BASE``) play task ``(seed - EVAL_BASE) % size``
  of the held-out pool, the same composite at ``seed_kwarg + size``. reasoning-gym draws row
  ``i`` of a dataset seeded ``s`` from ``Random(s + i)`` (the composite picks the task from it,
  each generator ``j`` its row from ``Random(s + j + 1 + i)``), so the two pools' random
  streams are disjoint: no evaluation question is drawn from a training row's stream.

Multi-turn with a Python tool (``tool=python``, envs/python_turns.py): before answering, the
model may run Python programs (``<tool_call>{"name": "python", "arguments": {"code": ...}}
</tool_call>``, at most ``max_tool_calls``), each in a resource-bounded process without network
(envs/python_tool.py, its limits in ``python``), and reads what they print in a tool message;
its ``<answer>`` reply is scored as above.

Invariants: ``reset(seed)`` is a pure function of (kwargs, seed); ``step`` never raises on model
output (a reply without an ``<answer>`` tag scores ``invalid_penalty``, default 0.0, which is
reasoning-gym's score of no answer, and sets ``info["unparsable"]``). ``expert(seed)``, the
warm start's teacher (``sft.steps``, trainer/warm_start.py), answers the task's own gold answer in
the tag, ``<answer>{entry["answer"]}</answer>``: it teaches the format the reward needs (a small
model never writes the tag zero-shot, so RL alone sees no reward) and scores 1.0 by the library's
scoring on the tasks tested. Bad settings (an unknown
task, ``size <= 0``, a config for a task not listed) raise one ValueError naming the fix.
"""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any, Mapping, Optional, Sequence

from earl_megatron.envs.base import Env, StepResult
from earl_megatron.envs.python_turns import PythonTurns
from earl_megatron.seeds import EVAL_BASE, EXPERT_BASE

HELP = "pip install reasoning-gym==0.1.25 (the envs extra: pip install -e '.[envs]')"


def _rg():
    try:
        import reasoning_gym
        from reasoning_gym import composite, utils
    except ImportError as e:
        raise ImportError(f"env=reasoning_gym needs the reasoning-gym package ({e}); "
                          f"{HELP}") from None
    return reasoning_gym, composite, utils


def known_tasks() -> tuple[str, ...]:
    """reasoning-gym's registered task names."""
    from reasoning_gym.factory import DATASETS

    _rg()
    return tuple(sorted(DATASETS))


@functools.lru_cache(maxsize=32)
def _pool(tasks: tuple[str, ...], config_json: str, seed: int, size: int):
    # one composite per (tasks, settings, seed, size) per process: every episode builds its own
    # environment, and some generators read word lists or tables when constructed
    _, composite, _ = _rg()
    config = json.loads(config_json)
    specs = [composite.DatasetSpec(name=t, weight=1.0, config=dict(config.get(t, {})))
             for t in tasks]
    return composite.CompositeDataset(composite.CompositeConfig(size=size, seed=seed,
                                                                datasets=specs))


def pool_row(seed: int, size: int) -> tuple[bool, int]:
    """(held out, row) the episode seed ``seed`` plays (module docstring)."""
    if EVAL_BASE <= seed < EXPERT_BASE:
        return True, (seed - EVAL_BASE) % size
    return False, seed % size


class ReasoningGymEnv(Env):
    """One reasoning-gym question per episode, scored by reasoning-gym (module docstring)."""

    name = "reasoning_gym"

    def __init__(self, tasks: Sequence[str] | str = ("basic_arithmetic",), size: int = 1000,
                 seed: int = 0, config: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 system_prompt: str = "direct", invalid_penalty: float = 0.0,
                 tool: Optional[str] = None, max_tool_calls: int = 4,
                 python: Optional[Mapping[str, Any]] = None):
        super().__init__(invalid_penalty)
        self.tools = PythonTurns(tool, max_tool_calls, python)
        _, _, utils = _rg()
        tasks = (tasks,) if isinstance(tasks, str) else tuple(str(t) for t in tasks)
        known = known_tasks()
        if not tasks:
            raise ValueError("env.kwargs.tasks is empty: name at least one reasoning-gym task, "
                             "e.g. env.kwargs.tasks=[basic_arithmetic]")
        for t in tasks:
            if t not in known:
                close = difflib.get_close_matches(t, known, n=3)
                raise ValueError(f"unknown reasoning-gym task {t!r} in env.kwargs.tasks"
                                 f"{f' (did you mean {close}?)' if close else ''}; the "
                                 f"{len(known)} tasks: reasoning_gym.factory.DATASETS")
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"env.kwargs.tasks={list(tasks)} names a task twice; list each once")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"env.kwargs.size={size!r}: the number of training tasks must be a "
                             "positive integer, e.g. env.kwargs.size=1000")
        config = {str(k): dict(v) for k, v in (config or {}).items()}
        if set(config) - set(tasks):
            raise ValueError(f"env.kwargs.config has settings for {sorted(set(config) - set(tasks))}"
                             f", which env.kwargs.tasks={list(tasks)} does not list; add the "
                             "task or drop its settings")
        for t, settings in config.items():
            if {"seed", "size"} & set(settings):
                raise ValueError(f"env.kwargs.config.{t} sets seed or size; the pools set both "
                                 "(env.kwargs.seed, env.kwargs.size): drop them there")
        self.tasks, self.size, self.seed = tasks, size, int(seed)
        self._config_json = json.dumps(config, sort_keys=True)
        self._system_prompt = self.tools.prompt(
            utils.SYSTEM_PROMPTS.get(system_prompt, system_prompt))
        self._extract = utils.extract_answer
        self.dataset = self.held_out = None
        try:   # a generator's own check of its settings fails here, not at the first episode
            self.dataset = self.pool(False)
        except (AssertionError, TypeError, ValueError) as e:
            raise ValueError(f"reasoning-gym refused env.kwargs.config={config}: "
                             f"{type(e).__name__}: {e}; see the task's config class "
                             "(reasoning_gym.factory.DATASETS[name][1])") from None
        self.entry: dict = {}
        self._scorer = self.dataset

    def pool(self, held_out: bool):
        """The training pool, or the held-out one (module docstring)."""
        seed = self.seed + self.size if held_out else self.seed
        return _pool(self.tasks, self._config_json, seed, self.size)

    def task(self, seed: int) -> dict:
        """reasoning-gym's entry (question, answer, metadata) episode ``seed`` plays."""
        held_out, row = pool_row(int(seed), self.size)
        return self.pool(held_out)[row]

    def score(self, reply: str) -> tuple[Optional[str], float]:
        """(the answer reasoning-gym extracts from ``reply``, its score for this episode's
        task): what ``step`` pays, for readers that check a recorded reply."""
        answer = self._extract(reply)
        return answer, float(self._scorer.score_answer(answer, self.entry))

    def expert(self, seed: int) -> list[str]:
        """The warm start's teacher for the episode ``reset(seed)`` starts: the gold answer in
        reasoning-gym's answer tag (module docstring); with the Python tool, first a program
        that prints it where the task has one (envs/python_turns.py ``expert_program``)."""
        entry = self.task(seed)
        return self.tools.expert(entry) + [f"<answer>{entry['answer']}</answer>"]

    @property
    def system_prompt(self) -> str:
        return self._system_prompt

    def _reset(self, seed: int) -> str:
        held_out, row = pool_row(seed, self.size)
        self._scorer = self.pool(held_out)   # the dataset that drew the entry scores it
        self.entry = self._scorer[row]
        self.tools.reset()
        return self.entry["question"]

    def _step(self, action: str) -> StepResult:
        task = self.entry["metadata"]["source_dataset"]
        turn = self.tools.step(action, functools.partial(self.invalid, task=task))
        if turn is not None:   # a tool call (None: an answer, scored here)
            return turn
        answer, reward = self.score(action)
        if answer is None:
            return self.invalid("unparsable", "no <answer></answer> in the reply", task=task,
                                **self.tools.counts())
        return StepResult(f"score: {reward:g}", reward, True,
                          {"task": task, "answer": answer[:200], "correct": reward >= 1.0,
                           **self.tools.counts()})
