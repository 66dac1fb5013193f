"""Agent programs as episodes: the tasks file, the entry function, its reward, its failures.

    env.name=agent
    env.kwargs.entry=package.module:function     agent(task, base_url, api_key, model) -> reward
                                                 (imported from PYTHONPATH or the working
                                                 directory: examples.agents.calculator_openai:agent
                                                 from the repository root)
    env.kwargs.tasks=PATH                        JSONL or parquet, one task (a dict) per row
    env.kwargs.reward=package.module:function    optional: reward(task, messages) -> reward

For each episode the trainer opens an episode on the endpoint (agents/server.py) and calls the
entry with the task row, the episode's ``base_url`` ({base}/v1, what ``openai.OpenAI`` takes),
the run's key and the model name. A coroutine function runs on this module's event loop; a
plain function in a daemon thread of its own; at most ``concurrency`` at once. Coroutines run on
one event loop for the whole process (``agents_loop``), so a client an agent keeps between
episodes stays usable from one rollout to the next. The episode's
reward is, first found: the value the entry returned (a number, or a dict with "reward" and
optional "info"), what the agent posted to {base}/reward, ``reward(task, messages)`` on the
conversation as the agent last saw it. Without an entry the built-in agent sends the row's
``messages`` (or ``prompt`` as one user message) once: the single-turn dataset-and-reward setup.

``run_agents`` plays a list of tasks to their end (one rollout stage); ``start_agent`` starts one
episode and hands back a future (asynchronous RL: trainer/agent_pool.py keeps it across stages).

Failures never stop the run: an agent that raises (or finds no reward) loses its episode
(``error`` holds its last line), one past ``timeout_s`` too (``timed_out``; a thread cannot be
killed, so its later calls meet 410 and it dies on its own). Invariant: ``run_agents`` returns
one Outcome per task, in order, after every episode is closed on the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence


class AgentConfigError(ValueError):
    """An entry, reward or tasks file that cannot be used (the message says what to fix)."""


def resolve(name: str, what: str) -> Callable:
    """``package.module:function`` imported, or AgentConfigError naming the problem."""
    module, sep, attr = str(name).partition(":")
    if not sep or not module or not attr:
        raise AgentConfigError(f"env.kwargs.{what}={name!r}: write package.module:function")
    # the working directory is importable, as under ``python -m`` (the ranks) and uvicorn: the
    # ``earl`` console script's own sys.path starts at its bin/ directory instead
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise AgentConfigError(f"env.kwargs.{what}={name!r}: cannot import {module!r} ({e}); "
                               "install it or put it on PYTHONPATH") from None
    except AttributeError:
        raise AgentConfigError(f"env.kwargs.{what}={name!r}: {module!r} has no {attr!r}") \
            from None
    if not callable(fn):
        raise AgentConfigError(f"env.kwargs.{what}={name!r} is not callable")
    return fn


def load_tasks(path: str) -> list[dict]:
    """Every row of a JSONL or parquet file, as dicts (AgentConfigError names the line)."""
    p = Path(path)
    if not p.is_file():
        raise AgentConfigError(f"env.kwargs.tasks={path}: no such file; write one task per "
                               "line as JSON (or a parquet table)")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise AgentConfigError(f"{path}: reading parquet needs pyarrow (pip install "
                                   "pyarrow), or write the tasks as JSONL") from None
        rows = pq.read_table(p).to_pylist()
    else:
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise AgentConfigError(f"{path}:{n}: not JSON ({e.msg}); one JSON object a "
                                       "line") from None
            if not isinstance(row, dict):
                raise AgentConfigError(f"{path}:{n}: a task is a JSON object, got "
                                       f"{type(row).__name__}")
            rows.append(row)
    if not rows:
        raise AgentConfigError(f"env.kwargs.tasks={path} holds no tasks")
    return rows


def builtin_messages(task: dict) -> list[dict]:
    """The built-in agent's one request: the row's ``messages``, or its ``prompt`` as a user
    message."""
    if isinstance(task.get("messages"), list):
        return task["messages"]
    if isinstance(task.get("prompt"), str):
        return [{"role": "user", "content": task["prompt"]}]
    raise AgentConfigError(f"task {str(task)[:80]}: without env.kwargs.entry each task needs "
                           "'messages' (a chat) or 'prompt' (a string)")


async def builtin_agent(task: dict, base_url: str, api_key: str, model: str):
    """Send the task once; the reward function scores the answer (returns None)."""
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        r = await client.post(f"{base_url}/chat/completions",
                              headers={"Authorization": f"Bearer {api_key}"},
                              json={"model": model, "messages": builtin_messages(task)})
        r.raise_for_status()
    return None


@dataclass
class Outcome:
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    error: str = ""
    """The last line of what the agent raised ("" when it did not)."""
    timed_out: bool = False
    episode: Any = None
    """The AgentEpisode it played (closed): its rows and counts."""

    @property
    def lost(self) -> bool:
        return bool(self.error) or self.timed_out


def _reward_of(value: Any) -> Optional[tuple[float, dict]]:
    if value is None:
        return None
    if isinstance(value, dict) and isinstance(value.get("reward"), (int, float)):
        return float(value["reward"]), dict(value.get("info") or {})
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), {}
    raise TypeError(f"the agent returned {type(value).__name__} {str(value)[:60]!r}; return a "
                    "number, a dict with 'reward', or None (then post to {base}/reward)")


def _last_line(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text.splitlines()[-1][:500] if text else type(e).__name__


async def _in_thread(fn: Callable, *args):
    # a daemon thread of its own: a timed-out agent cannot be killed, and must not hold the
    # process (an executor's threads are joined at exit)
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(how, value):
        try:
            loop.call_soon_threadsafe(lambda: fut.done() or how(value))
        except RuntimeError:
            pass  # the rollout ended long ago (the agent timed out): nobody is waiting

    def run():
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting episode
            settle(fut.set_exception, e)
        else:
            settle(fut.set_result, value)

    threading.Thread(target=run, name="agent", daemon=True).start()
    return await fut


async def _one(server, task: dict, agent: Callable, reward_fn: Optional[Callable],
               timeout_s: float, gate: asyncio.Semaphore,
               opened: Optional[Callable] = None) -> Outcome:
    async with gate:
        ep = server.open_episode(task)
        if opened is not None:
            opened(ep)
        args = (task, ep.base_url + "/v1", server.api_key, server.model_name)
        out = Outcome(episode=ep)
        try:
            call = agent(*args) if inspect.iscoroutinefunction(agent) else _in_thread(agent,
                                                                                      *args)
            value = await asyncio.wait_for(call, timeout_s)
            got = _reward_of(value) or (
                (ep.posted["reward"], ep.posted["info"]) if ep.posted else None)
            if got is None and reward_fn is not None:
                got = _reward_of(reward_fn(task, list(ep.last_messages)))
            if got is None:
                raise RuntimeError("no reward: the agent returned None, posted nothing to "
                                   "{base}/reward and env.kwargs.reward is not set")
            out.reward, out.info = got
        except asyncio.TimeoutError:
            out.timed_out = True
        except Exception as e:  # noqa: BLE001 - the episode is lost, the run goes on
            if ep.finish_reason == "max_turns" and reward_fn is not None:
                try:  # the endpoint ended the episode: score what it played
                    got = _reward_of(reward_fn(task, list(ep.last_messages)))
                    out.reward, out.info = got if got else (0.0, {})
                except Exception as e2:  # noqa: BLE001
                    out.error = _last_line(e2)
            elif ep.finish_reason != "max_turns":
                out.error = _last_line(e)
        finally:
            server.close_episode(ep)
        return out


_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


def agents_loop() -> asyncio.AbstractEventLoop:
    """The event loop every coroutine agent of this process runs on, in a daemon thread, the
    same for every rollout: an agent framework that keeps an async client between calls (as
    langchain-openai does) finds its loop alive in the next iteration."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="agents-loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


def run_agents(server, tasks: Sequence[dict], agent: Callable,
               reward_fn: Optional[Callable], *, concurrency: int, timeout_s: float
               ) -> list[Outcome]:
    """Play one episode per task (module docstring) on ``agents_loop()``; blocks until all are
    over."""
    async def main():
        gate = asyncio.Semaphore(max(1, concurrency))
        return await asyncio.gather(*(_one(server, t, agent, reward_fn, timeout_s, gate)
                                      for t in tasks))

    return list(asyncio.run_coroutine_threadsafe(main(), agents_loop()).result())


def agent_gate(concurrency: int) -> asyncio.Semaphore:
    """A semaphore of ``agents_loop()`` admitting ``concurrency`` agents at once, for
    ``start_agent``."""
    async def make():
        return asyncio.Semaphore(max(1, concurrency))

    return asyncio.run_coroutine_threadsafe(make(), agents_loop()).result()


def start_agent(server, task: dict, agent: Callable, reward_fn: Optional[Callable], *,
                timeout_s: float, gate: asyncio.Semaphore,
                opened: Optional[Callable] = None) -> concurrent.futures.Future:
    """One episode started on ``agents_loop()`` and not waited for (asynchronous RL keeps it
    running across rollout stages): a future of its Outcome. ``opened(ep)`` is called with its
    AgentEpisode when it opens on the server (after ``gate`` admits it). Cancelling the future
    ends the episode: the server closes it (its later calls meet 410)."""
    return asyncio.run_coroutine_threadsafe(
        _one(server, task, agent, reward_fn, timeout_s, gate, opened), agents_loop())
