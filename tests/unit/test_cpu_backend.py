"""The CPU backend is explicit and scoped: it patches only inside the context and restores all."""

import torch

from earl_megatron.runtime.cpu_backend import CpuRNGStatesTracker, cpu_backend, is_active


def test_scoped_and_restored():
    before = torch.cuda.current_device
    assert not is_active()
    with cpu_backend():
        assert is_active()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1, device=0).device.type == "cpu"
        assert torch.empty(3).cuda().device.type == "cpu"
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.arange(3).to(torch.cuda.current_device()).device.type == "cpu"
        with cpu_backend():  # re-entrant: a no-op
            assert is_active()
        assert is_active()
    assert not is_active()
    assert torch.cuda.current_device is before
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_megatron_tracker_is_replaced_and_restored():
    from megatron.core.tensor_parallel import random as mrandom
    saved = mrandom._CUDA_RNG_STATE_TRACKER
    with cpu_backend():
        tracker = mrandom.get_cuda_rng_tracker()
        assert isinstance(tracker, CpuRNGStatesTracker)
    assert mrandom._CUDA_RNG_STATE_TRACKER is saved


def test_rng_tracker_fork_is_reproducible_and_isolated():
    tr = CpuRNGStatesTracker()
    tr.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tr.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)
    tr2 = CpuRNGStatesTracker()
    tr2.add("model-parallel-rng", 123)
    with tr2.fork():
        b = torch.rand(3)
    assert torch.equal(a, b)
    with tr.fork():
        c = torch.rand(3)
    assert not torch.equal(a, c)  # the forked stream advances


def test_unredirected_skips_the_mode_but_answers_current_device():
    import pytest

    from earl_megatron.runtime.cpu_backend import unredirected

    with unredirected():  # outside the backend: a no-op
        assert torch.zeros(1).device.type == "cpu"
    with cpu_backend():
        saved = torch.cuda.current_device
        with unredirected():
            assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
            with pytest.raises((RuntimeError, AssertionError)):
                torch.zeros(1, device="cuda")  # no silent rewrite inside: it fails loudly
        assert torch.cuda.current_device is saved
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # the mode is back
