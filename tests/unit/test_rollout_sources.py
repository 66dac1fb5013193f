"""The rollout engines' one interface and the SGLang engine's weight sources, on one gloo rank
with no server started: every engine implements every method the loops call, the placement's
``weights=`` picks the source (and with it whether the servers share the policy's devices), and
each source refuses, with the fix, what does not apply to it. The servers themselves run in
tests/sglang (test_trainer_sglang.py colocated, test_split_sglang.py split)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.trainer.rollout import EmbeddedRollout, EpisodeSpec, Rollout
from earl_megatron.trainer.rollout_engines import make_rollout
from earl_megatron.trainer.sglang_rollout import HandoffWeights, LocalWeights, SGLangRollout
from earl_megatron.trainer.sglang_servers import replica_leaders

SPEC = EpisodeSpec(env="connect_four", env_kwargs={}, max_turns=2, max_context_tokens=64,
                   max_action_tokens=4, top_p=1.0)


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()


def _sglang(out, **kw):
    return make_rollout("sglang", SPEC, None, model=ModelConfig(), python="/nonexistent/python",
                        out_dir=out, **kw)


def test_every_engine_implements_every_method_the_loops_call():
    called = {name for name, f in vars(Rollout).items()
              if inspect.isfunction(f) and not name.startswith("_")}
    assert called == {"play", "play_pool", "sync", "ensure_servers", "receive",
                      "push_received", "metrics", "take_starts", "close"}
    for engine in (EmbeddedRollout, SGLangRollout):
        for name in called:
            want = list(inspect.signature(getattr(Rollout, name)).parameters)
            assert list(inspect.signature(getattr(engine, name)).parameters) == want, \
                (engine.__name__, name)


def test_the_placement_picks_the_source_and_whether_servers_share_the_device(one_rank):
    local = _sglang(one_rank, device="cuda", bucket_mb=2.0)
    assert isinstance(local.source, LocalWeights) and local.source.bucket_bytes == 2 << 20
    assert local.servers.ranks == (0,) and local.servers.ranks_group is None
    assert local.servers.shares_device        # colocated on a GPU: memory saver, release
    assert not _sglang(one_rank, device="cpu").servers.shares_device   # no GPU to share
    pool = _sglang(one_rank, device="cuda", ranks=[0], weights="handoff")
    assert isinstance(pool.source, HandoffWeights)
    assert not pool.servers.shares_device     # a rollout pool's GPUs are the servers' own
    for r in (local, pool):
        assert r.engine is None and r.last_push == [] and r.endpoints == []
        assert r.metrics()["rollout_weight_version"] == "it0"


def test_each_source_refuses_what_does_not_apply_to_it(one_rank):
    policy = SimpleNamespace(layout=ParallelLayout(dp=1))   # read for its layout only
    pool = _sglang(one_rank, device="cpu", ranks=[0], weights="handoff")
    with pytest.raises(RuntimeError, match="hold no weights yet.*handoff"):
        pool.play(policy, [0, 1], temperature=1.0, sample_seed=0)
    with pytest.raises(RuntimeError, match="hold no weights yet.*handoff"):
        pool.play_pool(policy, None, 0, sample_seed=0)
    with pytest.raises(RuntimeError, match="by the handoff.*not sync"):
        pool.sync(policy)
    with pytest.raises(RuntimeError, match="ensure_servers, receive"):
        pool.push_received()
    local = _sglang(one_rank, device="cpu")
    local.sync(policy)     # no servers yet: the first play pushes before its first request
    assert local.metrics()["rollout_weight_version"] == "it0"
    with pytest.raises(RuntimeError, match="by sync after TRAIN.*weights='handoff'"):
        local.receive([], None)
    with pytest.raises(RuntimeError, match="by sync after TRAIN.*weights='handoff'"):
        local.push_received()


def test_bad_engine_arguments_name_the_fix(one_rank):
    with pytest.raises(ValueError, match="weights='remote'.*use local.*or handoff"):
        _sglang(one_rank, device="cpu", weights="remote")
    with pytest.raises(ValueError, match="give ranks= and ranks_group="):
        _sglang(one_rank, device="cpu", weights="handoff")
    with pytest.raises(ValueError, match=r"rank 0 is not one of the servers' ranks \(1, 2\)"):
        _sglang(one_rank, device="cpu", ranks=[1, 2], weights="handoff")


def test_the_embedded_engine_takes_its_weights_with_its_model():
    r = EmbeddedRollout(SPEC, None)
    assert r.ensure_servers(ParallelLayout(dp=1)) is None and r.push_received() is None
    with pytest.raises(RuntimeError, match="writes into.*hand_off"):
        r.receive([], None)


def test_replica_leaders_are_each_replicas_first_rank_of_the_servers_ranks():
    assert replica_leaders(ParallelLayout(tp=2, dp=2), [4, 5, 6, 7]) == (4, 6)
    assert replica_leaders(ParallelLayout(dp=3), [1, 2, 3]) == (1, 2, 3)
    assert replica_leaders(ParallelLayout(tp=4), range(4)) == (0,)
