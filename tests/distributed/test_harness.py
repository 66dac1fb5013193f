"""The multi-process harness: results in rank order, failures and hangs surface quickly."""

import time

import pytest

from earl_megatron.testing.multiproc import run_distributed


def _allreduce_rank():
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _raise_on_rank1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return 0


def _hang_on_rank0():
    import torch.distributed as dist
    if dist.get_rank() == 0:
        time.sleep(3600)   # past pytest's own timeout: only the harness's kill ends it
    return 0


def test_results_in_rank_order():
    assert run_distributed(_allreduce_rank, 3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_worker_error_is_reported():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(_raise_on_rank1, 2, timeout=60)


def test_hang_is_killed():
    # no bound on the elapsed time (worker start-up depends on the machine's load): the hang
    # outlasts pytest's timeout, so returning at all means the harness killed it
    with pytest.raises(TimeoutError, match="_hang_on_rank0 on 2 ranks ran past 8s"):
        run_distributed(_hang_on_rank0, 2, timeout=8)
