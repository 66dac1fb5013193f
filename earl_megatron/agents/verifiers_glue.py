"""verifiers environments as agent programs: ``env=verifiers env.kwargs.id=MODULE``.

    env=verifiers                    recipes/env/verifiers.yaml: env.name=agent with these kwargs
    env.kwargs.id=MODULE             an installed verifiers environment (a module with
                                     ``load_environment``), loaded by ``verifiers.load_environment``
    env.kwargs.args={k: v, ...}      passed to its ``load_environment(**args)``

A verifiers environment runs its own rollouts through an OpenAI client and scores them with its
rubric. Here it IS an agent program (agents/programs.py): its tasks are the rows of its dataset
(``tasks[seed % len(tasks)]``; an evaluation plays its eval dataset's rows when it has one), and
for each episode ``play`` hands ``Environment.run_rollout`` a client pointed at the episode's
base URL, so every call it makes is decoded, recorded and trained token-in/token-out by the
endpoint; the episode's reward is the rubric's score of that rollout. Nothing else differs from
an agent program, so everything they compose with (asynchronous RL, split placement, GRPO
groups, dynamic sampling) applies unchanged.

Invariants:
- One environment per process and (id, args): ``load`` caches it (the pre-launch check and the
  replica leader's player load it once each). Loading restores the process's SIGINT and SIGTERM
  handlers afterwards: verifiers' ``Environment.__post_init__`` installs its own, which would
  replace the trainer's stop handler (trainer/stop.py).
- A rollout that ends with an error other than the model's own invalid reply (an empty message)
  is lost (the episode trains nothing, ``error`` holds verifiers' error chain); an invalid reply
  keeps the rubric's score, as verifiers gives it.
- Every bad input is one AgentConfigError naming the fix: verifiers not installed, the module
  not importable, no ``load_environment``, its call raising, no training dataset, a rubric that
  scores whole groups (verifiers' group reward functions: not supported, each episode here is
  scored alone), turns above ``rollout.max_turns``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional

from earl_megatron.agents.programs import AgentConfigError

INSTALL = "pip install 'earl_megatron[verifiers]'"
_CACHE: dict = {}
_LOCK = threading.Lock()


def _module_name(env_id: str) -> str:
    """The module verifiers' loader imports for ``env_id`` (its own rule, env_utils.py)."""
    return env_id.replace("-", "_").split("/")[-1]


def _vf():
    try:
        import verifiers
    except ImportError as e:
        raise AgentConfigError(f"env=verifiers needs the verifiers package ({e}); "
                               f"{INSTALL}") from None
    return verifiers


def load_environment(env_id: str, args: dict):
    """``verifiers.load_environment(env_id, **args)``, checked (module docstring), once per
    process and (id, args)."""
    key = (env_id, json.dumps(args, sort_keys=True, default=str))
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = _load(env_id, dict(args))
        return _CACHE[key]


def _load(env_id: str, args: dict):
    vf = _vf()
    name = _module_name(env_id)
    where = f"env.kwargs.id={env_id}"
    # the working directory is importable, as for env.kwargs.entry (agents/programs.py)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise AgentConfigError(f"{where}: cannot import module {name!r} ({e}); install the "
                               "environment (pip install, or `vf-install`/`prime env install`) "
                               "or put it on PYTHONPATH") from None
    if not callable(getattr(module, "load_environment", None)):
        raise AgentConfigError(f"{where}: module {name!r} has no load_environment(); point "
                               "env.kwargs.id at a verifiers environment module")
    saved = ({s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
             if threading.current_thread() is threading.main_thread() else {})
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as e:  # noqa: BLE001 - the environment's own code: any error is input's
        cause = e.__cause__ or e
        raise AgentConfigError(f"{where}: load_environment(**{args}) raised "
                               f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]}; "
                               "check env.kwargs.args") from None
    finally:
        for s, handler in saved.items():   # verifiers installs its own (module docstring)
            signal.signal(s, handler)
    if not isinstance(env, vf.Environment):
        raise AgentConfigError(f"{where}: load_environment returned {type(env).__name__}, "
                               "not a verifiers Environment")
    if env.requires_group_rollouts:
        raise AgentConfigError(f"{where}: its rubric has group reward functions (they score "
                               "a group of rollouts together); each episode here is scored "
                               "alone: use per-rollout reward functions")
    return env


def _rows(dataset) -> list[dict]:
    return [dict(row) for row in dataset] if dataset is not None else []


@dataclass
class VerifiersProgram:
    """An environment's tasks and its agent (``play``), in agents/programs.py's terms."""

    env: Any
    tasks: list
    eval_tasks: list

    async def play(self, task: dict, base_url: str, api_key: str, model: str) -> dict:
        """One rollout of ``task`` through the episode's endpoint: the rubric's reward, and
        its metrics and stop condition as the episode's info."""
        from openai import AsyncOpenAI

        vf = _vf()
        # no retries: a refused call is the endpoint's answer (410 after the episode closed)
        client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key=api_key,
                                                            max_retries=0))
        sampling = {k: v for k, v in (self.env.sampling_args or {}).items() if k != "n"}
        try:
            out = await self.env.run_rollout(task, client, model, sampling)
        finally:
            await client.close()
        error = out.get("error")
        if error and not _invalid_reply(error):
            raise RuntimeError(f"verifiers rollout failed: {out.get('error_chain') or error}")
        info = {"vf_metrics": {k: float(v) for k, v in (out.get("metrics") or {}).items()},
                "vf_stop": out.get("stop_condition")}
        if error:
            info["vf_error"] = error.get("error")
        return {"reward": float(out["reward"]), "info": info}


def _invalid_reply(error: dict) -> bool:
    """Whether verifiers' error is one of its invalid-model-reply kinds (the model's output,
    which the rubric scores, not a failure of the rollout)."""
    from verifiers import errors

    cls = getattr(errors, str(error.get("error")), None)
    return isinstance(cls, type) and issubclass(cls, errors.InvalidModelResponseError)


def verifiers_program(env_id: str, args: Optional[dict], max_turns: Optional[int] = None
                      ) -> VerifiersProgram:
    """The program of environment ``env_id`` (loaded by ``load_environment``), its tasks
    checked; ``max_turns``: rollout.max_turns, which the environment's turns must fit."""
    env = load_environment(env_id, dict(args or {}))
    where = f"env.kwargs.id={env_id}"
    tasks = _rows(env.build_dataset())
    if not tasks:
        raise AgentConfigError(f"{where}: the environment has no training dataset (rows to "
                               "play); give its load_environment a dataset= (an eval_dataset "
                               "alone only evaluates)")
    turns = getattr(env, "max_turns", -1)
    if max_turns is not None and isinstance(turns, int) and turns > max_turns:
        raise AgentConfigError(f"{where}: the environment plays up to {turns} turns but "
                               f"rollout.max_turns={max_turns} (the endpoint ends an episode "
                               f"there): set rollout.max_turns={turns}")
    return VerifiersProgram(env, tasks, _rows(env.build_eval_dataset()) or tasks)
