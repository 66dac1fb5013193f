"""The one bridge to ``megatron.core.parallel_state``: build and tear down groups for a layout.

Every other module receives a ``ParallelLayout`` (and, where it needs communicators, a
``ProcessGroupCollection`` from ``current_pg_collection()``); none imports parallel_state.

``build_groups(layout)`` creates Megatron-Core's groups for the layout on the already
initialised default process group; ``destroy_groups()`` destroys every group Megatron created
(``parallel_state._global_process_group_list``) in addition to resetting its globals, because
``destroy_model_parallel()`` alone leaks ~90 fds and ~50 threads per cycle on gloo.

Invariants:
- At most one layout is active; ``build_groups`` on an active one first destroys it.
- Group timeouts are short (``timeout_s``, default 120 s): a mismatched collective fails fast.
- A regroup deregisters the old groups before creating new ones, and frees them (gloo's
  destructor sleeps ~30 ms a group) on helper threads, at most two layouts' worth in flight;
  ``wait_released()`` joins them.
- The layout is checked against the world size before any group is created.
"""

from __future__ import annotations

import datetime
import threading
from typing import Optional

import torch
import torch.distributed as dist

from earl_megatron.plan.layout import ModelShape, ParallelLayout

_ACTIVE: Optional[ParallelLayout] = None


def active_layout() -> Optional[ParallelLayout]:
    return _ACTIVE


def build_groups(layout: ParallelLayout, model: Optional[ModelShape] = None, *,
                 timeout_s: float = 120.0, seed: Optional[int] = None) -> ParallelLayout:
    """Create Megatron-Core's process groups for ``layout`` (collective over the world)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    global _ACTIVE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "earl_megatron.runtime.dist.init_distributed() (or run under torchrun) "
                           "before building groups")
    layout.check(dist.get_world_size(), model)
    if _ACTIVE is not None or ps.model_parallel_is_initialized():
        destroy_groups(background=True)
    backend = dist.get_backend()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        distributed_timeout_minutes=timeout_s / 60.0,
        order="tp-cp-ep-dp-pp",
        # With a gloo default backend the regular groups are gloo already; Megatron's extra gloo
        # groups would only double the fds and threads.
        create_gloo_process_groups=(backend != "gloo"),
    )
    _ACTIVE = layout
    if seed is not None:
        model_parallel_cuda_manual_seed(seed)
    return layout


def destroy_groups(*, background: bool = False) -> None:
    """Destroy every group of the active layout and reset Megatron's globals.

    ``background``: the groups are deregistered (unusable) at once, but the last references are
    dropped on a helper thread. Gloo's ProcessGroup destructor sleeps, with the GIL released:
    each connection's close waits for its device loop's next 10 ms epoll tick, ~30 ms per group
    of 4 and ~20 groups per layout, so ~0.25 s of a regroup is waiting. ``build_groups`` uses it;
    at most two layouts' groups are in flight (a third waits for the oldest), and a plain
    ``destroy_groups()`` waits for everything (``wait_released``)."""
    from megatron.core import parallel_state as ps

    global _ACTIVE
    if not background:
        wait_released()
    # Megatron keeps references to groups in module globals; reset those first, then destroy
    # each group object exactly once (several globals can alias one group).
    pgs = list({id(g): g for g in (ps._global_process_group_list or []) if g is not None}
               .values())
    ps.destroy_model_parallel()
    _deregister(pgs)
    _clear_megatron_caches()
    _ACTIVE = None
    if background:
        _release_later(pgs)


def _deregister(pgs: list) -> None:
    for g in pgs:
        if g in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(g)


_RELEASING: list[threading.Thread] = []
_MAX_RELEASING = 2


def _release_later(pgs: list) -> None:
    """Drop ``pgs`` (the caller's last references to these groups) on a helper thread."""
    _RELEASING[:] = [t for t in _RELEASING if t.is_alive()]
    while len(_RELEASING) >= _MAX_RELEASING:   # bound the fds and threads in flight
        _RELEASING.pop(0).join()
    # not a daemon: interpreter exit joins it rather than freezing it inside a destructor
    t = threading.Thread(target=pgs.clear, name="earl-release-groups")
    t.start()
    _RELEASING.append(t)


def wait_released() -> None:
    """Block until groups handed to helper threads are destroyed (fds and threads freed)."""
    while _RELEASING:
        _RELEASING.pop(0).join()


def _clear_megatron_caches() -> None:
    """Caches keyed on the old groups' sizes that must not survive a regroup."""
    from megatron.core import parallel_state as ps

    if hasattr(ps, "_GLOBAL_MEMORY_BUFFER"):
        ps._GLOBAL_MEMORY_BUFFER = None


def has_gloo_side_groups() -> bool:
    """Whether Megatron's extra gloo groups exist (only with a non-gloo default backend)."""
    return dist.get_backend() != "gloo"


def current_pg_collection():
    """Megatron-Core's ProcessGroupCollection for the active layout."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if _ACTIVE is None:
        raise RuntimeError("no layout is active: call build_groups(layout) first")
    return ProcessGroupCollection.use_mpu_process_groups()


def coords_of_this_rank():
    """This rank's (tp, cp, pp, dp) coordinates under the active layout, as Megatron sees them."""
    from megatron.core import parallel_state as ps

    return dict(tp=ps.get_tensor_model_parallel_rank(), cp=ps.get_context_parallel_rank(),
                pp=ps.get_pipeline_model_parallel_rank(),
                dp=ps.get_data_parallel_rank(with_context_parallel=False))


def tp_group():
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_group()


def cp_group():
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def pp_group():
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_group()


def dp_group(with_context_parallel: bool = False):
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group(with_context_parallel=with_context_parallel)


def is_pipeline_first_stage() -> bool:
    from megatron.core import parallel_state as ps
    return ps.is_pipeline_first_stage()


def is_pipeline_last_stage() -> bool:
    from megatron.core import parallel_state as ps
    return ps.is_pipeline_last_stage()


def pipeline_prev_next_ranks():
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()


def set_virtual_pipeline_rank(rank: Optional[int]) -> None:
    from megatron.core import parallel_state as ps
    ps.set_virtual_pipeline_model_parallel_rank(rank)


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
