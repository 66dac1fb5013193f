"""Routing replay for mixture-of-experts models, the rollout's half: record each token's experts
while decoding, keep them with the episode, and carry them as data.

The trainer's half (replaying them in the LOGPROB and TRAIN forwards, per-token codes for the
dispatch) is models/routing_replay.py; this module drives the same per-model RouterReplay
objects (``routers``) in RECORD mode:

- ``recording(model)``: RECORD mode for a block; ``recorded(model)`` then gives the last
  forward's indices, one [tokens, topk] tensor per local layer (the router's token order:
  [s, b] flattened s-major).

An episode's routes are int16 [tokens fed, layers, topk]: entry j holds the experts input token
j was routed to. Every turn re-prefills the episode's whole context, so a turn records routes
for tokens an earlier turn already fed; ``extend`` keeps the earlier ones. Invariant: a token's
routes are those of the first forward that fed it, the forward whose outputs sampled the
tokens after it. That holds across rollout stages too: an asynchronous run's live episode is
re-prefilled under newer weights and perhaps another layout, and the experts replayed for its
older tokens stay the ones they were sampled with. ``to_json``/``from_json`` put routes into a
checkpoint's loop state and back, exactly (trainer/episode_pool.py).
"""

from __future__ import annotations

import base64
import contextlib
from typing import Optional

import torch

from earl_megatron.models.routing_replay import routers, set_action

__all__ = ["routers", "recording", "recorded", "extend", "to_json", "from_json"]


@contextlib.contextmanager
def recording(model):
    """Every forward in the block records its top-k indices (``recorded`` reads the last)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = set_action(model, RouterReplayAction.RECORD)
    try:
        yield
    finally:
        for rp in replays:
            rp.clear_router_replay_action()


def recorded(model) -> list[torch.Tensor]:
    """The last forward's top-k indices, [tokens, topk] per local MoE layer (under recording)."""
    out = [rp.get_recorded_indices() for rp in routers(model)]
    if any(t is None for t in out):
        raise RuntimeError("no routes recorded: run a forward under recording(model) first")
    return out


def extend(kept: Optional[torch.Tensor], new: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An episode's routes after a turn: ``kept`` (the tokens fed before it) followed by the
    turn's ``new`` routes of the tokens it fed first (``new`` covers the whole context: the turn
    re-prefilled it). None: the engine records no routes."""
    if kept is None or new is None:
        return new
    if len(kept) > len(new) or kept.shape[1:] != new.shape[1:]:
        raise ValueError(f"a turn's routes {tuple(new.shape)} do not extend the episode's "
                         f"{tuple(kept.shape)}: the engine must route the whole context")
    return torch.cat([kept, new[len(kept):].to(kept.dtype)])


def to_json(routes: Optional[torch.Tensor]) -> Optional[dict]:
    """Routes as JSON: the shape and the int16 bytes in base64 (exact; a tenth of a list's
    size)."""
    if routes is None:
        return None
    t = routes.to(torch.int16).contiguous().cpu()
    return {"shape": list(t.shape),
            "int16": base64.b64encode(t.numpy().astype("<i2").tobytes()).decode("ascii")}


def from_json(d) -> Optional[torch.Tensor]:
    """``to_json``'s routes back (a tensor passes through: the pool's own in-memory copies)."""
    if d is None or isinstance(d, torch.Tensor):
        return d
    import numpy as np

    raw = np.frombuffer(base64.b64decode(d["int16"]), dtype="<i2").astype(np.int16)
    return torch.from_numpy(raw).view(*d["shape"])
