"""Routing replay for mixture-of-experts models, the model's and the trainer's side: drive each
MoE router's RouterReplay, and carry a sample's recorded experts to the LOGPROB and TRAIN
forwards as per-token tensors.

An MoE router picks each token's top-k experts from its own scores; two forwards of the same
tokens whose numerics differ slightly (another layout, a KV-cached decode against a full
forward, weights a train step apart) can pick different experts for a token near a tie, and
then the whole token's output differs, not by rounding. Routing replay (Megatron-Core 0.16's
``RouterReplay``, megatron/core/transformer/moe/router_replay.py) makes a later forward use the
top-k indices the rollout recorded instead of its own choice (it still weights them by its own
scores, so gradients flow through the router as usual). Recording while decoding is the
rollout's half (rollout/routing_replay.py); this module is what the re-scoring and the train
step use, so trainer/ does not climb back into rollout/ for it.

Megatron's RouterReplay is driven per model here, not through its process-wide instance list
(a process holds several models at once: the rollout engine's, the policy's, the reference's,
and old ones after a layout switch):

- ``routers(model)``: the RouterReplay of every MoE layer of this pp_stage, in layer order,
  attached on first use (exactly what ``TopKRouter.__init__`` does under
  ``moe_enable_routing_replay``) and dropped from Megatron's global list, so nothing leaks.
- ``replaying(model, targets)``: REPLAY_FORWARD with one [tokens, topk] tensor per local layer.
- ``route_specs`` / ``encode`` / ``decode``: a sample's routes as one int64 per token and layer,
  dispatched like every other per-token tensor; ``micro_batch_targets`` and
  ``replaying_micro_batches`` replay them micro-batch by micro-batch in Megatron's schedules.

Token order is the router's: its input is the hidden states [s, b, h] of this rank (s already
this rank's part under sequence or context parallelism), flattened s-major: token t = s_i * b +
b_i. ``to_targets`` turns per-sample routes [b, s, layers, topk] into that order.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch


def _topk_routers(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def routers(model) -> list:
    """This pp_stage's RouterReplay objects in layer order (attached once; see the docstring)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    found = _topk_routers(model)
    if not found:
        raise ValueError("routing replay needs a mixture-of-experts model (no MoE router in "
                         "this model); set algorithm.routing_replay=false for a dense model")
    for r in found:
        if r.router_replay is None:
            r.router_replay = RouterReplay()
            # driven per model here: keep Megatron's process-wide list from holding it forever
            RouterReplay.global_router_replay_instances.remove(r.router_replay)
    return [r.router_replay for r in found]


def set_action(model, action) -> list:
    """Every router of ``model`` in ``action`` with no indices held; its RouterReplays."""
    replays = routers(model)
    for rp in replays:
        rp.clear_indices()
        rp.set_router_replay_action(action)
    return replays


@contextlib.contextmanager
def replaying(model, targets: Sequence[torch.Tensor]):
    """Forwards in the block use ``targets`` (one [tokens, topk] per local MoE layer) as their
    experts. One forward per block: the backward needs no targets (no recomputation here)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = set_action(model, RouterReplayAction.REPLAY_FORWARD)
    if len(targets) != len(replays):
        raise ValueError(f"{len(targets)} layers of routes for {len(replays)} MoE layers on "
                         "this pp_stage")
    try:
        for rp, t in zip(replays, targets):
            rp.set_target_indices(t)
        yield
    finally:
        for rp in replays:
            rp.clear_router_replay_action()
            rp.clear_indices()


def to_targets(routes: torch.Tensor, first_layer: int, num_local_layers: int
               ) -> list[torch.Tensor]:
    """Per-sample routes [b, s, layers, topk] (global layers) -> this pp_stage's targets in the
    router's token order: [s * b, topk] per local layer, s-major."""
    b, s, _, k = routes.shape
    local = routes[:, :, first_layer:first_layer + num_local_layers].permute(2, 1, 0, 3)
    return [local[i].reshape(s * b, k).long() for i in range(num_local_layers)]


# --- routes as per-token tensors, replayed micro-batch by micro-batch --------------------------
# The dispatcher moves 1-D per-token tensors; a token's top-k experts of one layer travel as one
# int64, sum_j idx_j * E**j (E = 128, k = 8 fits: 2**56). One tensor per layer.

def route_specs(num_layers: int) -> tuple:
    """The per-token tensors routing replay adds to the LOGPROB and TRAIN dispatch."""
    from earl_megatron.plan.placement import TensorSpec

    return tuple(TensorSpec(f"routes_{layer}", "int64", per_token=True, pp_stages="all")
                 for layer in range(num_layers))


def encode(routes: torch.Tensor, num_experts: int, length: int) -> dict[str, torch.Tensor]:
    """An episode's routes [inputs, layers, topk] -> {routes_<layer>: [length] int64}, aligned
    with ``input_ids`` (entry j: the experts of input token j); padding gets experts 0..k-1."""
    n, layers, k = routes.shape
    if n > length:
        raise ValueError(f"{n} routed tokens do not fit {length} predictions")
    weights = num_experts ** torch.arange(k, dtype=torch.long)
    pad = int((torch.arange(k, dtype=torch.long) * weights).sum())
    codes = (routes.long() * weights).sum(-1)           # [n, layers]
    out = {}
    for layer in range(layers):
        row = torch.full((length,), pad, dtype=torch.long)
        row[:n] = codes[:, layer]
        out[f"routes_{layer}"] = row
    return out


def decode(codes: torch.Tensor, num_experts: int, topk: int) -> torch.Tensor:
    """[...] int64 codes -> [..., topk] expert indices. All-zero codes (the all-masked rows that
    fill a micro-batch schedule) become experts 0..k-1, a valid top-k."""
    idx = torch.stack([(codes // num_experts ** j) % num_experts for j in range(topk)], dim=-1)
    if topk > 1:
        idx = torch.where((codes == 0)[..., None], torch.arange(topk, device=codes.device), idx)
    return idx


def micro_batch_targets(module, batches: Sequence[dict], num_experts: int, topk: int,
                        tp: int, tp_rank: int, sequence_parallel: bool) -> list[list[torch.Tensor]]:
    """Per micro-batch, this pp_stage's replay targets in the router's token order: the
    micro-batch's [rows, s] codes (s: this cp rank's part), under sequence parallelism this tp
    rank's s / tp slice, [s, rows] flattened s-major."""
    first = module.decoder.layers[0].layer_number - 1
    n = len(routers(module))
    out = []
    for mb in batches:
        per_layer = []
        for layer in range(first, first + n):
            codes = mb[f"routes_{layer}"]
            if sequence_parallel and tp > 1:
                part = codes.shape[1] // tp
                codes = codes[:, tp_rank * part:(tp_rank + 1) * part]
            idx = decode(codes, num_experts, topk).transpose(0, 1)   # [s, rows, k]
            per_layer.append(idx.reshape(-1, topk))
        out.append(per_layer)
    return out


@contextlib.contextmanager
def replaying_micro_batches(module, targets: list[list[torch.Tensor]]):
    """Replay ``targets[i]`` in the i-th forward of ``module`` in the block (Megatron's
    schedules run the micro-batches' forwards in data order, on every pp_stage)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = set_action(module, RouterReplayAction.REPLAY_FORWARD)
    queue = list(targets)

    def before_forward(_module, _args):
        if not queue:
            raise RuntimeError("routing replay: more forwards than micro-batches with routes")
        for rp, t in zip(replays, queue.pop(0)):
            rp.clear_indices()
            rp.set_target_indices(t)

    handle = module.register_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()
        for rp in replays:
            rp.clear_router_replay_action()
            rp.clear_indices()
