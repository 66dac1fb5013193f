"""One backend rule for every collective (runtime/dist.py): the world is created with torch's
device-mapped backend string, every Megatron-Core group inherits it, and the collectives the
trainer runs on CPU data (the stop agreements, a replica's agreement) go through groups that can
carry them. On this CPU host the string is "gloo"; a GPU host's is "cpu:gloo,cuda:nccl",
parsed by torch into the device map the GPU run uses."""

import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from earl_megatron.runtime.dist import world_backend
from earl_megatron.testing.multiproc import run_distributed


def test_world_backend_maps_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl():
    assert world_backend(cuda=False) == "gloo"
    assert world_backend(cuda=True) == "cpu:gloo,cuda:nccl"
    gpu = BackendConfig(dist.Backend(world_backend(cuda=True))).get_device_backend_map()
    assert gpu == {"cpu": "gloo", "cuda": "nccl"}
    cpu = BackendConfig(dist.Backend(world_backend(cuda=False))).get_device_backend_map()
    assert cpu == {"cpu": "gloo", "cuda": "gloo"}


def _groups_and_cpu_agreements(stop_on_rank):
    import torch

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.dist import device_backends, gloo_only
    from earl_megatron.trainer.stop import StopControl

    seen = {"world": dist.get_backend(), "gloo_only": gloo_only()}
    groups.set_group_timeout(45.0)
    groups.build_groups(ParallelLayout(tp=2, pp=2))
    for axis, group in (("tp", groups.tp_group()), ("pp", groups.pp_group()),
                        ("dp", groups.dp_group())):
        seen[axis] = device_backends(group)
        seen[f"{axis}_timeout_s"] = groups.group_timeout_s()
    stop = StopControl()
    stop._signalled = dist.get_rank() == stop_on_rank   # as SIGTERM would set it on one rank
    seen["replica"] = stop.replica_should_stop()     # tp then pp groups, a CPU tensor
    seen["world_stop"] = stop.world_should_stop()    # the default group, a CPU tensor
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=groups.tp_group())
    seen["tp_sum"] = t.item()
    groups.destroy_groups()
    groups.set_group_timeout(None)
    return seen


def test_every_group_inherits_the_device_mapped_backend_and_carries_cpu_agreements():
    # TP2xPP2 on 4 ranks: rank 0's replica is ranks {0, 1, 2, 3} (tp {0,1}, pp {0,2}); a stop
    # seen on rank 3 alone reaches rank 0 through tp then pp, and everyone through the world
    seen = run_distributed(_groups_and_cpu_agreements, 4, 3, timeout=180)
    for rank, s in enumerate(seen):
        assert s["world"] == "gloo" and s["gloo_only"], s
        for axis in ("tp", "pp", "dp"):
            assert s[axis] == {"cpu": "gloo"}, (rank, axis, s[axis])
            assert s[f"{axis}_timeout_s"] == 45.0
        assert s["world_stop"] is True and s["replica"] is True, (rank, s)
        assert s["tp_sum"] == {0: 1, 1: 1, 2: 5, 3: 5}[rank]


def test_world_backend_override_is_validated_before_anything_runs():
    import pytest

    from earl_megatron.config.train import ConfigError, TrainConfig

    for good in ("gloo", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"):
        ok = TrainConfig.from_dict({"cluster": {"world_backend": good}})
        assert ok.cluster.world_backend == good
    for bad in ("nccl", "cuda:nccl", "cpu:mpi", "tpu:gloo,cpu:gloo"):
        with pytest.raises(ConfigError, match="cluster.world_backend"):
            TrainConfig.from_dict({"cluster": {"world_backend": bad}})
