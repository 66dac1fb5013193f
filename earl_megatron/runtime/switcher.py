"""Switch a live Megatron-Core model (and its optimizer) to another layout on the same ranks.

``switch_layout(mol, new_layout)`` is collective over the world and runs, on every rank:

1. plan   ``plan_reshard(cfg, old, new)`` (pure, identical on every rank; plan/reshard_plan.py);
2. collect this rank's old shards: weights, and with an optimizer the fp32 Adam moments
   (``exp_avg``, ``exp_avg_sq``), the step count and, for bf16/fp16 weights, the fp32
   ``master`` copies Megatron's mixed-precision optimizer steps. The distributed optimizer
   holds each master and moment as a flat range per dp x cp rank; an all-reduce (sum of
   zero-padded ranges: exact) within its dp group turns them into whole per-parameter TP
   shards first. fp32 weights are their own master copies (Megatron's fp32 optimizers step the
   parameters themselves);
3. free the old model, its grad buffers and optimizer (``mol`` is consumed: ``_release`` breaks
   its reference cycles so that refcounting frees it now, without a full ``gc.collect()``);
4. regroup (``groups.build_groups`` via ``build_on_layout``) and build the model and optimizer
   for the new layout without Megatron's random init (``init=False``: parameters are
   ``torch.empty``, with the TP attributes set as init would have). Before any transfer every
   rank checks that the plan writes every row of every new local parameter;
5. local copies, then the plan's transfers in rounds of ``torch.distributed.batch_isend_irecv``
   on the WORLD group (the old groups are gone), each round sending at most ``bucket_bytes``
   and receiving at most ``bucket_bytes`` per rank (weights at their width, every state kind at
   4 bytes: bf16 weight + master + 2 moments = 14 bytes per element);
6. optimizer state into the new optimizer: same step count, moments and masters, so training
   continues on the same trajectory (tests/distributed/test_switcher.py: fp32 losses to 1e-5;
   bf16 masters and moments bit-identical after the switch, losses to 2e-3).

Peak memory per rank during a switch (documented in docs/switcher.md):
    old shard (weights [+ master] [+ 2 moments]) + new model, grad buffer and optimizer state
    + at most 2 x bucket_bytes of staging (non-contiguous sends are packed, non-contiguous
      receives land in a buffer; dim-0 slices are received in place)
    + with the distributed optimizer, whole-shard moments (and masters) on both sides (2 or 3
      x the local parameter elements x 4 bytes each) instead of the dp-sharded ones.
Never a second copy of the whole model on one rank: each rank holds only its two shards.

``switch_via_checkpoint`` is the disk baseline: Megatron's dist_checkpointing save under the old
layout and load under the new one (weights only), used by benchmarks/reshard.py and the tests.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.reshard_plan import EMBEDDING, OUTPUT, ReshardPlan, plan_reshard
from earl_megatron.runtime.build import ModelOnLayout, OptimizerSpec, build_on_layout
from earl_megatron.weights.sharding import global_name

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "master"
"""The fp32 master copy Megatron's mixed-precision optimizers step (bf16/fp16 weights)."""
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class SwitchStats:
    """Where a switch spent its time and what it moved (this rank's view)."""

    plan_s: float = 0.0
    collect_s: float = 0.0
    rebuild_s: float = 0.0
    """Fixed cost: free the old model, regroup, build the new model and optimizer."""
    transfer_s: float = 0.0
    load_state_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    rounds: int = 0
    plan: Optional[ReshardPlan] = field(default=None, repr=False)

    @property
    def total_s(self) -> float:
        return self.plan_s + self.collect_s + self.rebuild_s + self.transfer_s + self.load_state_s


def megatron_optimizers(optimizer) -> list:
    """The per-group Megatron optimizers inside a (possibly chained) Megatron optimizer."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def spec_of(optimizer) -> OptimizerSpec:
    """The OptimizerSpec that rebuilds ``optimizer`` (read from Megatron's OptimizerConfig)."""
    c = optimizer.config
    return OptimizerSpec(lr=c.lr, weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
                         adam_beta2=c.adam_beta2, adam_eps=c.adam_eps, clip_grad=c.clip_grad,
                         use_distributed_optimizer=c.use_distributed_optimizer)


def _full_name_of(local: str, mol: ModelOnLayout) -> tuple[str, str]:
    """(full tensor name in the plan, local name) of one local parameter."""
    g = global_name(local, mol.coords.pp, mol.layers_per_stage)
    if g == OUTPUT and mol.cfg.tie_word_embeddings:
        g = EMBEDDING
    return g, local


def _is_distributed(opt) -> bool:
    return hasattr(opt, "model_param_group_index_map")


def _buffer_params(opt) -> set:
    """Every param a distributed optimizer's grad buffers hold (identical on all dp peers)."""
    return {p for buf in opt.buffers for p in buf.params}


OptState = dict[str, dict[str, torch.Tensor]]
"""{local parameter name: {kind: whole TP shard (fp32)}}, kinds from ``_state_kinds``."""


def _has_masters(mol: ModelOnLayout) -> bool:
    """Megatron's optimizer keeps fp32 master copies (bf16/fp16 weights) that must move too."""
    return mol.optimizer is not None and mol.cfg.params_dtype != "float32"


def _state_kinds(masters: bool, stepped: bool) -> tuple[str, ...]:
    """The optimizer-state kinds a switch moves, in the order both ends post them."""
    return ((MASTER,) if masters else ()) + (MOMENTS if stepped else ())


def _plain_mains(opt) -> dict:
    """{model param: the param Adam steps} of a plain Megatron optimizer: its fp32 master copy
    (Float16OptimizerWithFloat16Params: float16_groups[i] <-> fp32_from_float16_groups[i]), or
    the param itself (fp32 params, FP32Optimizer)."""
    if not hasattr(opt, "float16_groups"):
        return {p: p for group in opt.optimizer.param_groups for p in group["params"]}
    mains = {p: m for model_g, main_g in zip(opt.float16_groups, opt.fp32_from_float16_groups)
             for p, m in zip(model_g, main_g)}
    mains.update({p: p for g in opt.fp32_from_fp32_groups for p in g})
    return mains


def _distributed_mains(opt) -> dict:
    """{model param: this rank's flat shard that Adam steps} of a distributed optimizer (only
    params with a non-empty range here): the fp32 master shard of a bf16/fp16 param, a view
    into an fp32 param. Not ``model_param_group_index_map``: its order is that of the grad
    buffers, while the optimizer's param groups list fp32 shards first, so with mixed dtypes
    in one group (fp32 norms of a bf16 model on CPU) ``_get_main_param_and_optimizer_states``
    returns another param's shard (Megatron-Core 0.16)."""
    pairs = (list(zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups))
             + list(zip(opt.model_fp32_groups, opt.shard_fp32_groups)))
    return {p: m for model_g, main_g in pairs for p, m in zip(model_g, main_g)}


def _optimizer_state_of(mol: ModelOnLayout) -> tuple[OptState, Optional[torch.Tensor]]:
    """This rank's optimizer state as whole TP shards, and one step tensor (None: never stepped).

    Kinds: ``master`` (fp32 master copy; only for bf16/fp16 weights) and, once stepped,
    ``exp_avg`` / ``exp_avg_sq``. The distributed optimizer's flat ranges are all-reduced within
    its dp x cp group into whole shards (a sum of zero-padded ranges: exact)."""
    names = {p: n for n, p in mol.module().named_parameters()}
    masters = _has_masters(mol)
    out: OptState = {}
    step = None
    for opt in megatron_optimizers(mol.optimizer):
        inner = opt.optimizer
        if not _is_distributed(opt):
            for p, main in _plain_mains(opt).items():
                st = inner.state.get(main)
                entry = {MASTER: main.detach()} if masters else {}
                if st:
                    entry.update({k: st[k] for k in MOMENTS})
                    step = st["step"]
                if entry:
                    out[names[p]] = entry
            continue
        # distributed optimizer: each dp x cp rank owns one flat range (possibly empty) of each
        # param in the optimizer's buffers; every peer walks the same params in the same order
        kinds = _state_kinds(masters, True)
        group, held, mains = opt.data_parallel_group, _buffer_params(opt), _distributed_mains(opt)
        for p, name in names.items():
            if p not in held:
                continue
            whole = torch.zeros((len(kinds), p.numel()), dtype=torch.float32, device=p.device)
            if p in mains:
                rng = opt._get_model_param_range_map(p)["param"]
                st = {MASTER: mains[p], **inner.state.get(mains[p], {})}
                step = st.get("step", step)
                for i, k in enumerate(kinds):
                    if k in st:
                        whole[i, rng.start:rng.end].copy_(st[k].detach().view(-1))
            dist.all_reduce(whole, group=group)
            out[name] = {k: whole[i].view(p.shape) for i, k in enumerate(kinds)}
    # ranks whose dp x cp peers stepped must agree on whether a state exists at all
    have = torch.tensor([0 if step is None else 1], dtype=torch.int64)
    dist.all_reduce(have, op=dist.ReduceOp.MAX)
    if have.item() and step is None:
        raise RuntimeError("this rank has no Adam state but others do; every rank must have "
                           "stepped the optimizer the same number of times before a switch")
    if step is None:   # the distributed path collected (zero) moments regardless
        keep = _state_kinds(masters, False)
        out = {n: {k: e[k] for k in keep} for n, e in out.items() if keep}
    return out, step


def _init_optimizer_state(mol: ModelOnLayout, step: Optional[torch.Tensor]) -> OptState:
    """The new optimizer's state, returned as whole TP shards to receive into.

    Plain optimizer: the shards ARE its state (masters received in place, zeroed moments
    installed under the master). Distributed: fresh whole shards, cut into each rank's flat
    range by ``_finish_distributed_state`` after the transfer."""
    names = {p: n for n, p in mol.module().named_parameters()}
    masters = _has_masters(mol)
    kinds = _state_kinds(masters, step is not None)
    targets: OptState = {}
    if not kinds:
        return targets
    for opt in megatron_optimizers(mol.optimizer):
        inner = opt.optimizer
        if _is_distributed(opt):
            held = _buffer_params(opt)
            for p, name in names.items():
                if p in held:
                    targets[name] = {k: torch.zeros(p.shape, dtype=torch.float32,
                                                    device=p.device) for k in kinds}
            continue
        for p, main in _plain_mains(opt).items():
            entry = {MASTER: main.detach()} if masters else {}
            if step is not None:
                st = {"step": step.clone()}
                st.update({k: torch.zeros_like(main) for k in MOMENTS})
                inner.state[main] = st
                entry.update({k: st[k] for k in MOMENTS})
            targets[names[p]] = entry
    return targets


def _finish_distributed_state(mol: ModelOnLayout, step: Optional[torch.Tensor],
                              whole: OptState) -> None:
    """Hand each dp x cp rank of a distributed optimizer its flat range of masters and moments."""
    names = {p: n for n, p in mol.module().named_parameters()}
    for opt in megatron_optimizers(mol.optimizer):
        if not _is_distributed(opt):
            continue
        inner, mains = opt.optimizer, _distributed_mains(opt)
        for p, name in names.items():
            if p not in mains:
                whole.pop(name, None)   # this rank steps no part of it
                continue
            rng = opt._get_model_param_range_map(p)["param"]
            main = mains[p]
            cut = lambda k: whole[name][k].reshape(-1)[rng.start:rng.end]  # noqa: E731
            if MASTER in whole[name]:
                main.detach().copy_(cut(MASTER).view_as(main))
            if step is not None:
                inner.state[main] = {"step": step.clone(),
                                     **{k: cut(k).clone().view_as(main) for k in MOMENTS}}
            del whole[name]


def _tensors_by_kind(mol: ModelOnLayout, state: OptState) -> dict[str, dict[str, torch.Tensor]]:
    """{kind: {local name: tensor}}: "param" first, then the optimizer-state kinds in order."""
    kinds = {"param": {n: p.detach() for n, p in mol.module().named_parameters()}}
    for k in (MASTER, *MOMENTS):
        if any(k in e for e in state.values()):
            kinds[k] = {n: e[k] for n, e in state.items()}
    return kinds


def switch_layout(mol: ModelOnLayout, new_layout: ParallelLayout, *,
                  optimizer: Optional[OptimizerSpec] = None,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  stats: Optional[SwitchStats] = None) -> ModelOnLayout:
    """Return the model (and optimizer) of ``mol`` in ``new_layout``; ``mol`` is consumed.

    ``optimizer``: the spec for the new optimizer; default: the old optimizer's own config.
    With no optimizer on ``mol`` only weights move (rollout / logprob stages)."""
    stats = stats if stats is not None else SwitchStats()
    cfg, old = mol.cfg, mol.layout
    new_layout.check(dist.get_world_size(), cfg.shape)
    t0 = time.perf_counter()
    plan = plan_reshard(cfg, old, new_layout)
    stats.plan = plan
    t1 = time.perf_counter()
    spec = optimizer or (spec_of(mol.optimizer) if mol.optimizer is not None else None)
    state, step = _optimizer_state_of(mol) if mol.optimizer is not None else ({}, None)
    src = _tensors_by_kind(mol, state)
    old_names = {n: _full_name_of(n, mol)[0] for n in src["param"]}
    ddp = hasattr(mol.model, "module")
    t2 = time.perf_counter()

    # free the old model now: only its parameter storages (and optimizer state) stay alive, via
    # `src`; its grad buffers go before the new model is allocated
    _release(mol.model)
    mol.model = mol.optimizer = mol.tcfg = None
    del state
    # no random init: the transfers below overwrite every element (_check_coverage proves it)
    new = build_on_layout(cfg, new_layout, weights=None, ddp=ddp, optimizer=spec, init=False)
    targets = _init_optimizer_state(new, step) if new.optimizer is not None else {}
    dst = _tensors_by_kind(new, targets)
    _check_names(plan, old_names, new)
    _check_coverage(plan, dist.get_rank(), dst["param"])
    # ranks finish building at different times; without this the first round's wait would be
    # billed to transfer time instead of the (fixed) rebuild
    dist.barrier()
    t3 = time.perf_counter()

    me = dist.get_rank()
    with torch.no_grad():
        for t in plan.local_copies:
            if t.dst != me:
                continue
            for kind in dst:
                d = dst[kind][t.dst_local].narrow(t.dim, t.dst_offset, t.rows)
                d.copy_(src[kind][t.src_local].narrow(t.dim, t.src_offset, t.rows))
                stats.bytes_local += d.numel() * d.element_size()
        # weights in their dtype, every optimizer-state kind in fp32 (identical on every rank)
        per_elem = plan.element_bytes + 4 * (len(dst) - 1)
        for rnd in plan.rounds(bucket_bytes, bytes_per_element=per_elem):
            _run_round(rnd, me, src, dst, stats)
            stats.rounds += 1
    del src
    t4 = time.perf_counter()
    if targets:
        _finish_distributed_state(new, step, targets)
    t5 = time.perf_counter()
    stats.plan_s += t1 - t0
    stats.collect_s += t2 - t1
    stats.rebuild_s += t3 - t2   # fixed costs: teardown, regroup, build
    stats.transfer_s += t4 - t3
    stats.load_state_s += t5 - t4
    return new


def _release(model) -> None:
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


def _run_round(rnd, me: int, src: dict, dst: dict, stats: SwitchStats) -> None:
    """One round of batched isend/irecv on the world group; both ends post in plan order."""
    ops, landings = [], []
    for t in rnd:
        if me not in (t.src, t.dst):
            continue
        for kind in dst:  # same kind order on both ends
            if t.src == me:
                buf = src[kind][t.src_local].narrow(t.dim, t.src_offset, t.rows).contiguous()
                ops.append(dist.P2POp(dist.isend, buf, t.dst))
                stats.bytes_sent += buf.numel() * buf.element_size()
            else:
                view = dst[kind][t.dst_local].narrow(t.dim, t.dst_offset, t.rows)
                buf = view if view.is_contiguous() else torch.empty(
                    view.shape, dtype=view.dtype, device=view.device)
                ops.append(dist.P2POp(dist.irecv, buf, t.src))
                if buf is not view:
                    landings.append((view, buf))
                stats.bytes_received += buf.numel() * buf.element_size()
    if not ops:
        return
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for view, buf in landings:
        view.copy_(buf)


def _check_names(plan: ReshardPlan, old_names: dict, new: ModelOnLayout) -> None:
    """Every live parameter must be a tensor the plan knows (else the names drifted, e.g. TE)."""
    new_names = {n: _full_name_of(n, new)[0] for n, _ in new.module().named_parameters()}
    known = {t.name for t in plan.transfers + plan.local_copies}
    unknown = sorted({g for g in list(old_names.values()) + list(new_names.values())
                      if g not in known})
    if unknown:
        raise KeyError(f"parameters {unknown[:4]} are not in the reshard plan; the model's "
                       "parameter names differ from weights/sharding.py's (TransformerEngine "
                       "spec?): add their split rules to plan/reshard_plan.py")


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


def switch_via_checkpoint(mol: ModelOnLayout, new_layout: ParallelLayout, ckpt_dir: str, *,
                          stats: Optional[SwitchStats] = None) -> ModelOnLayout:
    """Baseline: dist_checkpointing save under the old layout, load under the new (weights)."""
    from megatron.core import dist_checkpointing

    stats = stats if stats is not None else SwitchStats()
    cfg, ddp = mol.cfg, hasattr(mol.model, "module")
    t0 = time.perf_counter()
    os.makedirs(ckpt_dir, exist_ok=True)  # a shared filesystem: every rank sees one directory
    dist.barrier()
    dist_checkpointing.save(mol.module().sharded_state_dict(), ckpt_dir)
    t1 = time.perf_counter()
    # the same rebuild as switch_layout's (free, regroup, build without random init)
    _release(mol.model)
    mol.model = mol.optimizer = mol.tcfg = None
    new = build_on_layout(cfg, new_layout, weights=None, ddp=ddp, init=False)
    t2 = time.perf_counter()
    state = dist_checkpointing.load(new.module().sharded_state_dict(), ckpt_dir)
    missing = [k for k in new.module().load_state_dict(state, strict=False).missing_keys
               if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"the checkpoint left parameters {missing[:4]} unloaded")
    t3 = time.perf_counter()
    stats.collect_s += t1 - t0
    stats.rebuild_s += t2 - t1
    stats.transfer_s += t3 - t2
    return new
