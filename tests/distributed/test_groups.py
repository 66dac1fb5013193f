"""Process groups: rebuilds leave fds and threads flat; the layout cache reuses groups; invalid
layouts fail before groups.

- 100 rebuilds, each ended by ``destroy_groups()`` (and 100 regroups with the cache disabled):
  fds and threads flat after warm-up.
- A -> B -> A -> B with the cache: revisits create no group (``new_group`` calls counted) and
  reuse the same group objects; after every switch each group holds exactly the ranks the layout
  says (an all-reduce of 2**rank) and Megatron's getters report the layout's ranks and sizes.
- 3 layouts cycled through a cache of 2: every cached group stays registered, evicted ones are
  gone, fds and threads flat after the first cycle; ``destroy_groups()`` leaves only WORLD.
- A pool's local groups (made by its ranks alone) never make the world's ranks disagree: the
  world then asks for a key the pool made alone and for more layouts than the cache holds,
  and every rank creates and evicts alike (the old rule hung there).
"""

import pytest

from earl_megatron.testing.multiproc import run_distributed


def _rebuild_many(n, destroy_each):
    import os

    import psutil
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups

    proc = psutil.Process()
    layouts = [ParallelLayout(tp=2, dp=2), ParallelLayout(pp=2, cp=2), ParallelLayout(tp=4),
               ParallelLayout(cp=2, dp=2)]
    samples = []
    for i in range(n):
        lay = layouts[i % len(layouts)]
        # without destroy_groups() in between, a disabled cache must free each old layout itself
        groups.build_groups(lay, max_cached_layouts=0 if destroy_each else 1)
        # the groups must really work: an all-reduce over tp sums the tp ranks
        import torch
        t = torch.ones(1)
        dist.all_reduce(t, group=groups.tp_group())
        assert t.item() == lay.tp
        assert groups.coords_of_this_rank() == vars(lay.coords(dist.get_rank()))
        if destroy_each:
            groups.destroy_groups()
        else:
            assert groups.cached_layouts() == [lay]
            groups.wait_released()
        if i in (11, n - 1):   # the same layout (i % 4 == 3): its groups may be alive
            samples.append((len(os.listdir("/proc/self/fd")), proc.num_threads()))
    groups.destroy_groups()
    return samples


@pytest.mark.parametrize("destroy_each", [True, False], ids=["destroy_each", "uncached_regroup"])
def test_hundred_rebuilds_leave_fds_and_threads_flat(destroy_each):
    per_rank = run_distributed(_rebuild_many, 4, 100, destroy_each, timeout=300)
    for (fd12, th12), (fd_end, th_end) in per_rank:
        # after warm-up (first 12 cycles), 88 more cycles may not grow fds or threads:
        # without destroying every Megatron group this grows by ~90 fds and ~50 threads a cycle
        assert fd_end - fd12 <= 4, (fd12, fd_end)
        assert th_end - th12 <= 2, (th12, th_end)


def _invalid_layout():
    from megatron.core import parallel_state as ps

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import InvalidLayoutError, ParallelLayout
    from earl_megatron.runtime import groups

    mqa = ModelConfig(num_layers=4, num_attention_heads=8, num_query_groups=1, vocab_size=128)
    one_layer = ModelConfig(num_layers=1, num_attention_heads=8, num_query_groups=4, vocab_size=128)
    odd_vocab = ModelConfig(num_layers=4, num_attention_heads=8, num_query_groups=4, vocab_size=127)
    errors = []
    for lay, shape in ((ParallelLayout(tp=2, dp=2), mqa), (ParallelLayout(tp=2), mqa),
                       (ParallelLayout(pp=2), one_layer), (ParallelLayout(tp=2), odd_vocab)):
        try:
            groups.build_groups(lay, shape)
        except InvalidLayoutError as e:
            errors.append((e.axis, str(e)))
        # nothing was created for the invalid layout
        assert not ps.model_parallel_is_initialized()
    return errors


def test_invalid_layout_raises_before_any_group():
    errors = run_distributed(_invalid_layout, 2, timeout=120)[0]
    assert [a for a, _ in errors] == ["dp", "tp", "pp", "tp"]
    assert "!= world size 2" in errors[0][1]
    assert "num_query_groups=1" in errors[1][1]
    assert "exceeds num_layers=1" in errors[2][1]
    assert "vocab_size=127" in errors[3][1]
    assert all("Fix:" in msg for _, msg in errors)


def _check_active(lay):
    """Every group of the active layout holds exactly the layout's ranks, and Megatron's getters
    agree with the layout's arithmetic."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from earl_megatron.runtime import groups

    rank = dist.get_rank()
    for axis, g in (("tp", groups.tp_group()), ("cp", groups.cp_group()),
                    ("pp", groups.pp_group()), ("dp", groups.dp_group()),
                    ("dp-cp", groups.dp_group(with_context_parallel=True)),
                    ("tp-pp", ps.get_model_parallel_group())):   # Megatron's mp: no cp
        t = torch.tensor([2.0 ** rank], dtype=torch.float64)
        dist.all_reduce(t, group=g)
        members = lay.group_of(rank, axis)
        assert t.item() == sum(2.0 ** r for r in members), (lay, axis, t.item(), members)
    c = lay.coords(rank)
    got = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
           ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
           ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(),
           ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
           ps.get_pipeline_model_parallel_next_rank(), ps.is_pipeline_first_stage())
    pp_ranks = lay.group_of(rank, "pp")
    want = (c.tp, lay.tp, c.pp, lay.pp, c.cp, lay.cp, c.dp, lay.dp,
            pp_ranks[(c.pp + 1) % lay.pp], c.pp == 0)
    assert got == want, (lay, got, want)
    assert ps.get_global_memory_buffer() is not None


def _cycle_cached():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend

    created = []
    new_group = dist.new_group

    def counting_new_group(*args, **kwargs):   # Megatron looks it up on every call
        created.append(1)
        return new_group(*args, **kwargs)

    dist.new_group = counting_new_group
    groups.set_group_cache_size(4)
    try:
        a, b = ParallelLayout(tp=2, dp=2), ParallelLayout(pp=2, cp=2)
        out, first = [], {}
        with cpu_backend():   # seed=: Megatron's RNG tracker on CPU
            for lay in (a, b, a, b, a):
                n = len(created)
                groups.build_groups(lay, seed=3)
                _check_active(lay)
                pgs = (groups.tp_group(), groups.cp_group(), groups.pp_group(), groups.dp_group(),
                       ps.get_model_parallel_group())
                same = all(x is y for x, y in zip(first.setdefault(lay, pgs), pgs))
                # gloo: one group object per distinct rank list (TP2xDP2: the tp group IS the
                # model-parallel group, both ranks {2k, 2k+1})
                aliased = groups.tp_group() is ps.get_model_parallel_group() if lay == a \
                    else groups.cp_group() is not groups.pp_group()
                out.append((str(lay), len(created) - n, same,
                            len(dist.distributed_c10d._world.pg_map), aliased))
        del first, pgs
        groups.destroy_groups()
        assert not ps.model_parallel_is_initialized() and groups.cached_layouts() == []
        return out, len(dist.distributed_c10d._world.pg_map)
    finally:
        dist.new_group = new_group
        groups.set_group_cache_size(None)


def test_revisited_layouts_reuse_their_groups():
    for switches, registered in run_distributed(_cycle_cached, 4, timeout=180):
        created = [s[1] for s in switches]
        # first visits create one group per distinct rank list (9 on 4 ranks, where Megatron
        # asks for 41); revisits create none, reuse the same objects, and register nothing new
        # (WORLD + both layouts' groups throughout)
        assert 5 <= created[0] <= 12 and 5 <= created[1] <= 12 and created[2:] == [0, 0, 0], \
            created
        assert all(s[2] and s[4] for s in switches), switches
        assert len({s[3] for s in switches[1:]}) == 1, switches
        assert registered == 1   # only WORLD after destroy_groups()


def _evict_cycle(cycles):
    import os

    import psutil
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups

    proc = psutil.Process()
    layouts = [ParallelLayout(tp=2, dp=2), ParallelLayout(pp=2, cp=2), ParallelLayout(tp=4)]
    pg_map = dist.distributed_c10d._world.pg_map
    groups.set_group_cache_size(2)
    samples, cached = [], []
    try:
        for i in range(cycles):
            for lay in layouts:
                groups.build_groups(lay)
                _check_active(lay)
                cached.append([str(x) for x in groups.cached_layouts()])
                # every group of a cached layout is registered, layouts share no group, and
                # nothing else is (evicted groups are gone): WORLD + the cached layouts' groups
                alive = [g for e in groups._CACHE.values() for g in e.pgs]
                assert all(g in pg_map for g in alive)
                assert len({id(g) for g in alive}) == len(alive)
                assert len(pg_map) == 1 + len(alive), (len(pg_map), len(alive))
                del alive
            groups.wait_released()
            if i in (0, cycles - 1):
                samples.append((len(os.listdir("/proc/self/fd")), proc.num_threads()))
        groups.destroy_groups()
        from earl_megatron.runtime import megatron_globals
        state = {n: getattr(ps, n) for n in megatron_globals.SET | set(megatron_globals.UNUSED)}
        return dict(samples=samples, cached=cached, initialized=ps.model_parallel_is_initialized(),
                    registered=[pg is dist.GroupMember.WORLD for pg in pg_map],
                    leftover=sorted(n for n, v in state.items() if v is not None))
    finally:
        groups.set_group_cache_size(None)


def test_eviction_keeps_fds_and_threads_bounded():
    for r in run_distributed(_evict_cycle, 4, 6, timeout=240):
        (fd1, th1), (fd_end, th_end) = r["samples"]
        # LRU over 3 layouts with room for 2: every build evicts the oldest, so after the first
        # cycle the live groups are always two layouts' worth
        assert fd_end - fd1 <= 4, (fd1, fd_end)
        assert th_end - th1 <= 2, (th1, th_end)
        assert r["cached"][:4] == [["TP2xDP2"], ["TP2xDP2", "CP2xPP2"], ["CP2xPP2", "TP4"],
                                   ["TP4", "TP2xDP2"]]
        assert all(len(c) <= 2 for c in r["cached"])
        assert not r["initialized"]
        assert r["registered"] == [True]   # WORLD only
        assert r["leftover"] == []         # every parallel_state global back to None


def _as_ranks(v):
    """A parallel_state value with every group replaced by its ranks (comparable across runs)."""
    import torch.distributed as dist

    if isinstance(v, list):
        return [_as_ranks(x) for x in v]
    if isinstance(v, dist.ProcessGroup):
        return ("group", dist.get_process_group_ranks(v))
    return v


def _shim_against_megatron(layouts):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups, megatron_globals

    names = sorted(megatron_globals.SET)
    moe = ModelConfig(family="qwen3_moe", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                      num_attention_heads=4, num_query_groups=2, vocab_size=128, num_experts=4,
                      moe_ffn_hidden_size=32, moe_router_topk=2)
    out = []
    for spec in layouts:
        lay = ParallelLayout.parse(spec, dist.get_world_size(), moe)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
            context_parallel_size=lay.cp, expert_model_parallel_size=lay.ep,
            expert_tensor_parallel_size=lay.expert_tp, order="tp-cp-ep-dp-pp",
            create_gloo_process_groups=False)
        want = {n: _as_ranks(getattr(ps, n)) for n in names}
        groups.destroy_groups()       # Megatron's own groups, as untracked ones
        groups.build_groups(lay)
        got = {n: _as_ranks(getattr(ps, n)) for n in names}
        out.append((spec, {n: (want[n], got[n]) for n in names if want[n] != got[n]},
                    sum(v is not None for v in got.values())))
        groups.destroy_groups()
    return out


def test_the_shim_installs_what_initialize_model_parallel_sets():
    """On a pool that is the world, every global the shim sets holds the same ranks (groups) or
    list as Megatron-Core's own initialize_model_parallel sets, in dense, pp, cp and ep layouts."""
    layouts = ["tp2-dp2", "pp2-dp2", "tp2-pp2", "cp2-dp2", "pp4", "ep2", "ep4", "ep2,tp2,etp1",
               "ep2-pp2"]
    for per_layout in run_distributed(_shim_against_megatron, 4, layouts, timeout=300):
        for spec, diff, n_set in per_layout:
            assert diff == {}, (spec, diff)
            assert n_set >= 23, (spec, n_set)   # no gloo side groups on a gloo world


def _local_then_world():
    import torch
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups

    made, new_group = [], dist.new_group

    def counting_new_group(ranks, **kwargs):   # the world's groups, which every rank must make
        if not kwargs.get("use_local_synchronization"):
            made.append(tuple(ranks))
        return new_group(ranks, **kwargs)

    dist.new_group = counting_new_group
    dp2, tp2, dp4 = ParallelLayout(dp=2), ParallelLayout(tp=2), ParallelLayout(dp=4)
    groups.set_group_cache_size(2)
    try:
        sums = []
        groups.build_pool_groups((dp2, dp2))                 # the world's: every rank
        if dist.get_rank() < 2:                              # the first pool switches alone
            groups.build_pool_groups((tp2, dp2), local=True)
        # the world asks for the key pool 0 made alone, then more layouts than the cache holds
        for pools in ((tp2, dp2), (dp4,), (dp2, dp2)):
            groups.build_pool_groups(pools)
            for g in (groups.tp_group(), groups.dp_group()):
                x = torch.tensor([1.0 + dist.get_rank()])
                dist.all_reduce(x, group=g)
                sums.append(float(x))
        return sums, made
    finally:
        dist.new_group = new_group
        groups.destroy_groups()
        groups.set_group_cache_size(None)


def test_a_pools_local_groups_never_make_ranks_disagree():
    results = run_distributed(_local_then_world, 4, timeout=150)
    # every rank made the same world groups in the same order (torch's new_group requires it;
    # the old rule let ranks 0-1 take their local TP2 entry for the world's: 6 groups made
    # there against 9 on ranks 2-3, after which a group spanning both pools can hang)
    assert all(r[1] == results[0][1] for r in results), [len(r[1]) for r in results]
    # (tp, dp) sums per layout: TP2 on ranks 0-1 adds 1 + 2 over tp; DP2 pools add their two
    # ranks over dp; DP4 adds all four
    assert [r[0] for r in results] == [[3, 1, 1, 10, 1, 3], [3, 2, 2, 10, 2, 3],
                                       [3, 7, 3, 10, 3, 7], [4, 7, 4, 10, 4, 7]], results
