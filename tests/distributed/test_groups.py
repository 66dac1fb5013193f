"""Process groups: 100 rebuilds leave fds and threads flat; invalid layouts fail before groups."""

from earl_megatron.testing.multiproc import run_distributed


def _rebuild_many(n):
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
        groups.build_groups(lay)
        # the groups must really work: an all-reduce over tp sums the tp ranks
        import torch
        t = torch.ones(1)
        dist.all_reduce(t, group=groups.tp_group())
        assert t.item() == lay.tp
        assert groups.coords_of_this_rank() == vars(lay.coords(dist.get_rank()))
        groups.destroy_groups()
        if i in (9, n - 1):
            samples.append((len(os.listdir("/proc/self/fd")), proc.num_threads()))
    return samples


def test_hundred_rebuilds_leave_fds_and_threads_flat():
    per_rank = run_distributed(_rebuild_many, 4, 100, timeout=300)
    for (fd10, th10), (fd_end, th_end) in per_rank:
        # after warm-up (first 10 cycles), 90 more cycles may not grow fds or threads:
        # without destroying every Megatron group this grows by ~90 fds and ~50 threads a cycle
        assert fd_end - fd10 <= 4, (fd10, fd_end)
        assert th_end - th10 <= 2, (th10, th_end)


def _invalid_layout():
    from megatron.core import parallel_state as ps

    from earl_megatron.plan.layout import InvalidLayoutError, ModelShape, ParallelLayout
    from earl_megatron.runtime import groups

    mqa = ModelShape(num_layers=4, num_attention_heads=8, num_query_groups=1, vocab_size=128)
    one_layer = ModelShape(num_layers=1, num_attention_heads=8, num_query_groups=4, vocab_size=128)
    odd_vocab = ModelShape(num_layers=4, num_attention_heads=8, num_query_groups=4, vocab_size=127)
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
