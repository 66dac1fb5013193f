"""Switch a live Megatron-Core model (and its optimizer) to another layout on the same ranks.

``switch_layout(on_layout, new_layout)`` is collective over the world and runs, on every rank:

1. plan   ``plan_reshard(cfg, old, new)`` (pure, identical on every rank; plan/reshard_plan.py);
2. collect this rank's old shards: weights, and with an optimizer its state as flat ranges of
   the local parameters (runtime/optimizer_state.py: the fp32 ``master`` copies of bf16/fp16
   weights and, once stepped, ``exp_avg`` / ``exp_avg_sq``; whole parameters for the plain
   optimizer, each dp x cp rank's own range for the distributed one) and the step count;
3. free the old model, its grad buffers and optimizer (``on_layout`` is consumed:
   ``release_model`` breaks its reference cycles so that refcounting frees it now, without a
   full ``gc.collect()``);
4. regroup (``groups.build_groups`` via ``build_on_layout``) and build the model and optimizer
   for the new layout without Megatron's random init (``init=False``: parameters are
   ``torch.empty``, with the TP attributes set as init would have). Before any transfer every
   rank checks that the plan writes every row of every new local parameter;
5. one all-gather of metadata (every rank's old and new state ranges, weight dtypes), then the
   state plan (plan/state_plan.py): each new rank receives exactly its new flat range, each
   element from the old rank that owned it, itself when it did;
6. local copies, then the weight transfers and the state segments in rounds
   (runtime/transport.py) of at most ``bucket_bytes`` sent and received per rank: shared memory
   between the ranks of one gloo host (runtime/shm.py), else ``batch_isend_irecv`` on the WORLD
   group (the old groups are gone);
7. the new optimizer holds the same step count, moments and masters, so training continues on
   the same trajectory (tests/distributed/test_switcher.py: fp32 losses to 1e-5; bf16 masters
   and moments bit-identical after the switch, losses to 2e-3).

Peak memory per rank during a switch (documented in docs/switcher.md):
    old shard (weights [+ master] [+ 2 moments], each state only over the rank's own range)
    + new model, grad buffer and optimizer state
    + staging: at most 2 x bucket_bytes (isend/irecv: non-contiguous sends are packed,
      non-contiguous receives land in a buffer) or a shared outbox of at most bucket_bytes that
      the process keeps between switches (shm).
Never a second copy of the whole model on one rank: each rank holds only its two shards.

Mixture of experts: a rank's parameters are ``table.held_on(layout, rank)`` (only its ep rank's
experts) named by ``plan_names`` with the rank's ep coordinate, so experts move between EP / ETP
layouts as ordinary rows of the plan, and their Adam state (Megatron's expert optimizer in the
chain, sharded over edp by the distributed optimizer) as ordinary flat ranges
(tests/distributed/test_moe_switch.py: bit-exact weights and moments after every hop).

The disk baseline (dist_checkpointing save and load) is ``testing/baselines.switch_via_checkpoint``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.reshard_plan import ReshardPlan, plan_reshard
from earl_megatron.plan.state_plan import Block, plan_state_segments, segment_rounds
from earl_megatron.runtime import groups
from earl_megatron.plan.tensor_table import tensor_table
from earl_megatron.runtime.build import ModelOnLayout, OptimizerSpec, build_on_layout
from earl_megatron.runtime.optimizer_state import (
    has_masters, install_optimizer_state, optimizer_state, state_kinds)
from earl_megatron.runtime.transport import Message, Traffic, open_outboxes, run_rounds, unpack

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class SwitchStats:
    """Where a switch spent its time and what it moved (this rank's view)."""

    plan_s: float = 0.0
    collect_s: float = 0.0
    rebuild_s: float = 0.0
    """Fixed cost: free the old model, regroup, build the new model and optimizer."""
    transfer_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    rounds: int = 0
    transport: str = ""
    """"shm" (same-host shared memory) or "p2p" (batched isend/irecv)."""
    state_bytes_moved: int = 0
    """Optimizer-state bytes all ranks send (the minimum: see plan/state_plan.py)."""
    plan: Optional[ReshardPlan] = field(default=None, repr=False)


def spec_of(optimizer) -> OptimizerSpec:
    """The OptimizerSpec that rebuilds ``optimizer`` (read from Megatron's OptimizerConfig)."""
    c = optimizer.config
    return OptimizerSpec(lr=c.lr, weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
                         adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.clip_grad,
                         use_distributed_optimizer=c.use_distributed_optimizer)


def plan_names(cfg: ModelConfig, layout: ParallelLayout, pp_rank: int,
               names, ep_rank: int = 0) -> dict[str, str]:
    """{live parameter name: the reshard plan's local name} for one rank's parameters
    (pp_stage ``pp_rank``; of the experts, ep rank ``ep_rank``'s).

    The plan speaks the local spec; a TransformerEngine model names the pre-norms
    ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` and its grouped-GEMM
    experts ``experts.linear_fc1.weight<e>``. Both map to the same row of the tensor table, so
    either model switches (a name in neither spec: KeyError)."""
    table = tensor_table(cfg)
    return {n: table.name_on(table.row(table.global_name(n, pp_rank, layout.pp, ep_rank,
                                                         layout.ep)), layout) for n in names}


def plan_params(on_layout: ModelOnLayout) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(live name -> plan name, {plan name: parameter}) of this rank's model."""
    live = dict(on_layout.module().named_parameters())
    lay = on_layout.layout
    names = plan_names(on_layout.cfg, lay, on_layout.coords.pp, live,
                       lay.expert_coords(groups.pool_rank()).ep)
    return names, {names[n]: p.detach() for n, p in live.items()}


def switch_layout(on_layout: ModelOnLayout, new_layout: ParallelLayout, *,
                  optimizer: Optional[OptimizerSpec] = None,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, transport: str = "auto",
                  stats: Optional[SwitchStats] = None,
                  pools: Optional[tuple[ParallelLayout, ...]] = None) -> ModelOnLayout:
    """Return the model (and optimizer) of ``on_layout`` in ``new_layout``; ``on_layout`` is
    consumed.

    ``optimizer``: the spec for the new optimizer; default: the old optimizer's own config.
    With no optimizer on ``on_layout`` only weights move (rollout / logprob stages).
    ``transport``: "auto" (shared memory between the ranks of one gloo host, else batched
    isend/irecv), "p2p" or "shm" (an error where shared memory does not apply).
    ``pools``: split placement's pools, ``new_layout`` this rank's: the switch runs on the first
    pool (ranks 0 .., so plan ranks are global ranks) alone, its new groups made by its ranks
    (runtime/groups.py ``local``), its metadata and transfers on its group, over p2p (shared
    outboxes fence on the world)."""
    stats = stats if stats is not None else SwitchStats()
    cfg, old = on_layout.cfg, on_layout.layout
    group = None
    if pools is not None:
        if pools[0] != new_layout or dist.get_rank() >= new_layout.world_size:
            raise ValueError(f"a switch inside a pool runs on the first pool (ranks 0 ..), "
                             f"here {pools[0]}, not to {new_layout}")
        group, transport = groups.pool_group(), "p2p"
    new_layout.check(new_layout.world_size if pools else dist.get_world_size(), cfg)
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    t0 = time.perf_counter()
    plan = plan_reshard(cfg, old, new_layout)
    stats.plan = plan
    t1 = time.perf_counter()
    spec = optimizer or (spec_of(on_layout.optimizer) if on_layout.optimizer is not None else None)
    old_state, old_ranges, step = optimizer_state(on_layout) if on_layout.optimizer is not None \
        else ({}, {}, None)
    kinds = state_kinds(has_masters(on_layout), step is not None)
    names, src = plan_params(on_layout)
    old_state, old_ranges = ({names[n]: v for n, v in d.items()} for d in (old_state, old_ranges))
    ddp = hasattr(on_layout.model, "module")
    t2 = time.perf_counter()

    # free the old model now: only its parameter storages (and optimizer state) stay alive, via
    # `src` and `old_state`; its grad buffers go before the new model is allocated
    release_model(on_layout.model)
    on_layout.model = on_layout.optimizer = on_layout.tcfg = None
    # no random init: the transfers below overwrite every element (_check_coverage proves it)
    new = build_on_layout(cfg, new_layout, weights=None, ddp=ddp, optimizer=spec, init=False,
                          pools=pools, local=pools is not None)
    new_state, new_ranges = install_optimizer_state(new, step) if new.optimizer is not None \
        else ({}, {})
    names, dst = plan_params(new)
    new_state, new_ranges = ({names[n]: v for n, v in d.items()} for d in (new_state, new_ranges))
    if new.optimizer is not None and set(kinds) - set(state_kinds(has_masters(new), True)):
        raise ValueError("the new optimizer keeps no fp32 master copies but the old one did; "
                         "switch between optimizers of the same precision")
    _check_coverage(plan, dist.get_rank(), dst)
    me = dist.get_rank()
    # ranks finish building at different times; this collective is also the barrier that keeps
    # the first round's wait out of the transfer time
    meta = _gather_meta(plan, me, src, dst, old_ranges, new_ranges, group)
    segments = plan_state_segments(plan, meta["old"], meta["new"]) if kinds else ()
    t3 = time.perf_counter()

    def views(m: Message, sending: bool) -> list[torch.Tensor]:
        """The tensors message ``m`` reads (``sending``) or writes on this rank."""
        if isinstance(m.key, tuple):   # (state segment, kind)
            s, k = m.key
            name, box, state, ranges = (s.src_local, s.src_box, old_state, old_ranges) \
                if sending else (s.dst_local, s.dst_box, new_state, new_ranges)
            return _state_views(state[name][k], ranges[name], box.pieces(s.u, s.v))
        t = m.key
        return [src[t.src_local].narrow(t.dim, t.src_offset, t.rows) if sending
                else dst[t.dst_local].narrow(t.dim, t.dst_offset, t.rows)]

    with torch.no_grad():
        local = [Message(me, me, 0, t) for t in plan.local_copies if t.dst == me]
        local += [Message(me, me, 0, (s, k)) for s in segments if s.src == s.dst == me
                  for k in kinds]
        for m in local:
            ins, outs = views(m, True), views(m, False)
            if len(ins) == len(outs) == 1 and ins[0].shape == outs[0].shape:
                outs[0].copy_(ins[0])
            else:   # a state segment cut differently on the two sides
                unpack(torch.cat([v.reshape(-1) for v in ins]), outs)
            stats.bytes_local += sum(v.numel() * v.element_size() for v in outs)
        sizes = meta["itemsize"]
        rounds = [[Message(t.src, t.dst, t.elements * sizes[t.name], t)
                   for t in rnd] for rnd in plan.rounds(bucket_bytes)]
        rounds += [[Message(s.src, s.dst, 4 * s.elements, (s, k)) for s in rnd for k in kinds]
                   for rnd in segment_rounds(segments, 4 * len(kinds), bucket_bytes)]
        stats.state_bytes_moved = sum(4 * s.elements * len(kinds) for s in segments
                                      if s.src != s.dst)

        on_cpu = all(t.device.type == "cpu" for t in dst.values())
        traffic = Traffic()
        run_rounds(rounds, me, lambda m: views(m, True), lambda m: views(m, False),
                   open_outboxes(transport, rounds, on_cpu), traffic, group)
    t4 = time.perf_counter()
    stats.bytes_sent += traffic.bytes_sent
    stats.bytes_received += traffic.bytes_received
    stats.rounds += traffic.rounds
    stats.transport = traffic.transport
    stats.plan_s += t1 - t0
    stats.collect_s += t2 - t1
    stats.rebuild_s += t3 - t2   # fixed costs: teardown, regroup, build, metadata
    stats.transfer_s += t4 - t3
    return new


def _gather_meta(plan: ReshardPlan, me: int, src: dict, dst: dict, old_ranges: dict,
                 new_ranges: dict, group=None) -> dict:
    """Every rank's old and new state ranges and every moved tensor's weight element size
    (bf16 models keep some tensors, the norms, in fp32; a rank sees only its own tensors)."""
    itemsize = {}
    for t in plan.transfers:
        if t.src == me:
            itemsize[t.name] = src[t.src_local].element_size()
        elif t.dst == me:
            itemsize[t.name] = dst[t.dst_local].element_size()
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (old_ranges, new_ranges, itemsize), group=group)
    return {"old": {r: p[0] for r, p in enumerate(parts)},
            "new": {r: p[1] for r, p in enumerate(parts)},
            "itemsize": {n: size for p in parts for n, size in p[2].items()}}


def _state_views(flat: torch.Tensor, geometry: tuple, blocks: tuple[Block, ...]) -> list:
    """Views of the flat state tensor ``flat`` (flat elements [start, stop) of its parameter)
    for ``blocks`` (flat positions of the whole local parameter)."""
    _, start, _ = geometry
    base = flat.storage_offset() - start
    return [flat.as_strided((b.rows, b.cols), (b.stride, 1), base + b.start) for b in blocks]


def release_model(model) -> None:
    """Break the consumed model's reference cycles so that reference counting frees it now.

    A Megatron model is one big reference cycle: DDP's gradient hooks (closures over the DDP, held
    by the AccumulateGrad nodes in ``grad_accs``), modules' state-dict hooks (bound methods), and
    the TransformerConfig, into which forward_backward stores the DDP's bound ``no_sync``. Left
    to the cyclic collector it keeps its grad buffers and its layout's gloo groups (~12 threads
    and ~25 fds each) alive until the next full collection, and a full ``gc.collect()`` walks
    every object of the process (~400k here: 0.2-0.3 s of CPU per switch). Emptying every
    submodule's ``__dict__`` (the model is consumed: no one may use it after a switch) leaves no
    cycle: with gc disabled, DEBUG_SAVEALL finds 3 objects (one closure) after a whole switch."""
    for m in list(model.modules()):
        m.__dict__.clear()


def _check_coverage(plan: ReshardPlan, me: int, params: dict[str, torch.Tensor]) -> None:
    """Every element of every new local parameter is written by the plan (it is built with
    ``torch.empty``). The plan never writes a row twice (tests/unit/test_reshard_plan.py), so
    rows summing to the size along the split dim means every row is written once."""
    rows: dict[str, int] = {}
    dims: dict[str, int] = {}
    for t in plan.transfers + plan.local_copies:
        if t.dst == me:
            rows[t.dst_local] = rows.get(t.dst_local, 0) + t.rows
            dims[t.dst_local] = t.dim
    short = [n for n, p in params.items() if rows.get(n, 0) != (p.shape[dims[n]] if n in dims
                                                                 else -1)]
    if short:
        raise RuntimeError(f"the reshard plan leaves parameters {short[:4]} of rank {me} "
                           "(partly) unwritten; they would keep uninitialised memory")
