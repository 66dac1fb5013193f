"""Requests from many agent programs, batched into the rollout engine's ``generate`` calls.

The HTTP handlers (agents/server.py, on the server's event loop thread) ``submit`` one prompt
each and await its future; the replica's leader thread takes batches with ``take`` and decodes
them. A batch holds requests of equal sampling parameters (one ``generate`` call takes one
``SamplingParams``); it is dispatched as soon as every open episode has a request waiting
(nothing more can come), or ``window_s`` after its first request arrived (an agent busy in a
tool does not hold the others), and holds at most ``max_batch`` requests.

The embedded engine decodes on every rank of a replica in lockstep (tp and pp ranks run the
same forwards), so ``ReplicaDriver`` carries each batch from the leader, which serves HTTP, to
the replica's other ranks over a gloo group (``broadcast_object_list``), and every rank checks
the trainer's stop flag (a collective over the replica) before every batch, and at least every
``tick_s`` while the agents are busy elsewhere: a stop abandons the rollout within about a
second. SGLang servers batch requests themselves and only the leader plays (no group).

Each answer names the policy version that sampled it (``Answer.version``, the driver's
``version`` when it decoded the batch): under asynchronous RL an agent's call waits in the
broker while no rollout stage is serving (the weights are being trained) and is decoded by the
next stage, at the next version (trainer/agent_pool.py).

Invariants: every submitted request gets exactly one answer (its Generation, or the exception
its batch raised); ``generate`` calls happen in the same order with the same arguments on every
rank of the replica; the followers leave their loop exactly when the leader says so.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from earl_megatron.rollout.engine import SamplingParams


class Answer(concurrent.futures.Future):
    """A request's future; ``version`` is set (by the driver) before its result."""

    version: int = -1


@dataclass
class _Request:
    prompt: tuple[int, ...]
    params: SamplingParams
    future: Answer
    arrived: float
    on_token: Optional[Callable[[int, float], None]] = None
    """Hears each (token id, logprob) as the engine samples it (a streamed request)."""


class Broker:
    """Thread-safe queue of decode requests (see the module docstring)."""

    def __init__(self, window_s: float = 0.02, max_batch: int = 64):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1 (rollout.agent_max_batch)")
        self.window_s = float(window_s)
        self.max_batch = int(max_batch)
        """Requests one ``generate`` call takes at most (rollout.agent_max_batch); the rest wait
        for the next batch. A call's ``n`` choices are requests of their own, so n <= it."""
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self.open_episodes = 0
        """Episodes whose agent may still call (the server keeps it): when every one of them
        has a request waiting, the batch goes at once."""
        self._woken = False

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               on_token: Optional[Callable[[int, float], None]] = None) -> Answer:
        """``on_token(id, logprob)``: called from the driver's thread as each token is sampled,
        by an engine that streams (``streams_tokens``); the Answer holds them all either way."""
        fut = Answer()
        with self._cond:
            self._pending.append(_Request(tuple(prompt), params, fut, time.monotonic(),
                                          on_token))
            self._cond.notify_all()
        return fut

    def poke(self) -> None:
        """Wake ``take`` (an episode opened or closed: the count it waits on changed)."""
        with self._cond:
            self._cond.notify_all()

    def wake(self) -> None:
        """Make the current (or next) ``take`` return at once, [] when no batch is ready: the
        driver's ``done`` may have become true (an episode of the pool finished)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def take(self, timeout_s: float) -> list[_Request]:
        """The next batch (requests of one SamplingParams, oldest first), or [] after
        ``timeout_s`` (or a ``wake``) with nothing ready."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if self._pending:
                    first = self._pending[0]
                    full = len(self._pending) >= min(max(self.open_episodes, 1), self.max_batch)
                    if full or now >= first.arrived + self.window_s:
                        batch = [r for r in self._pending
                                 if r.params == first.params][:self.max_batch]
                        taken = {id(r) for r in batch}
                        self._pending = [r for r in self._pending if id(r) not in taken]
                        return batch
                    wait = min(first.arrived + self.window_s, deadline) - now
                else:
                    wait = deadline - now
                if wait <= 0 or self._woken:
                    self._woken = False
                    return []
                self._cond.wait(wait)

    def fail_all(self, error: BaseException) -> None:
        """Answer every waiting request with ``error`` (the rollout is over)."""
        with self._cond:
            pending, self._pending = self._pending, []
        for r in pending:
            if not r.future.done():
                r.future.set_exception(error)


def _streams(engine, batch: list[_Request]) -> dict:
    """generate's ``on_token`` for a batch with streamed requests, on an engine that streams
    (the embedded one; others answer at the end, and the stream then comes in one piece)."""
    hear = [r.on_token for r in batch]
    if not any(hear) or not getattr(engine, "streams_tokens", False):
        return {}

    def on_token(row: int, token: int, logprob: float) -> None:
        if hear[row] is not None:
            try:
                hear[row](token, logprob)
            except Exception:  # noqa: BLE001 - a listener gone (loop closed) never stops decoding
                hear[row] = None

    return {"on_token": on_token}


class ReplicaDriver:
    """Runs the leader's batches on every rank of a replica (see the module docstring).

    ``group``: the replica's ranks (leader first), None when the leader decodes alone.
    ``should_stop``: the trainer's stop check, called by every rank of the replica the same
    number of times (before every batch and every ``tick_s`` without one). ``version``: the
    policy version of the engine's weights, set on every answer (``Answer.version``)."""

    def __init__(self, engine, group=None, *,
                 should_stop: Optional[Callable[[], bool]] = None, tick_s: float = 1.0,
                 version: int = -1):
        self.engine, self.group = engine, group
        self.should_stop = should_stop
        self.tick_s = float(tick_s)
        self.version = int(version)
        self.batches = 0

    def _share(self, message):
        if self.group is None:
            return message
        box = [message]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def _stopping(self) -> bool:
        return bool(self.should_stop is not None and self.should_stop())

    def lead(self, broker: Broker, done: Callable[[], bool], seed: Callable[[int], int]
             ) -> bool:
        """Leader: decode batches until ``done()``; False when told to stop (the caller fails
        the waiting requests; the followers are released). Batch k samples with seed
        ``seed(k)`` unless its requests named one."""
        try:
            while not done():
                batch = broker.take(self.tick_s)
                if not batch:
                    self._share(("tick",))
                    if self._stopping():
                        return False
                    continue
                params = batch[0].params
                if params.seed is None:  # a request's own seed (serve) stands
                    params = SamplingParams(**{**params.__dict__, "seed": seed(self.batches)})
                prompts = [r.prompt for r in batch]
                self._share(("generate", prompts, params))
                if self._stopping():
                    return False
                try:
                    out = self.engine.generate(prompts, params, **_streams(self.engine, batch))
                except Exception as e:  # noqa: BLE001 - every waiting agent hears of it
                    for r in batch:
                        r.future.set_exception(e)
                    raise
                self.batches += 1
                for r, g in zip(batch, out, strict=True):
                    r.future.version = self.version
                    r.future.set_result(g)
            return True
        finally:
            self._share(("done",))

    def follow(self) -> bool:
        """A follower rank: run the leader's batches until it says done; False on a stop."""
        stopped = False
        while True:
            message = self._share(None)
            if message[0] == "done":
                return not stopped
            if stopped:
                continue
            if self._stopping():
                stopped = True  # the leader saw the same flag: it sends "done" next
                continue
            if message[0] == "generate":
                self.engine.generate(message[1], message[2])
                self.batches += 1
