"""rollout.placement=split's configuration: what it runs, and each thing it does not run yet
refused at construction (or by ``split_pools`` against the world) with one line naming the fix."""

import pytest

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.trainer.split import split_pools
from earl_megatron.trainer.split_sides import split_logprob_layout

SPLIT = {"layout": {"mode": "static", "rollout": "dp2", "logprob": "dp2", "train": "dp2"},
         "rollout": {"placement": "split", "episodes_per_iteration": 4},
         "algorithm": {"max_staleness": 1, "name": "grpo", "group_size": 2}}


def _cfg(**over) -> TrainConfig:
    d = {k: dict(v) for k, v in SPLIT.items()}
    for key, value in over.items():
        section, name = key.split("__")
        d.setdefault(section, {})[name] = value
    return TrainConfig.from_dict(d)


def test_split_pools_are_the_layouts_on_each_pools_ranks():
    t, r = split_pools(_cfg(), 4)
    assert (t.world_size, t.dp, r.world_size, r.dp) == (2, 2, 2, 2)
    t, r = split_pools(_cfg(layout__train="tp2", layout__logprob="tp2", layout__rollout="dp1",
                            rollout__pool_ranks=1), 3)
    assert (t.tp, t.world_size, r.world_size) == (2, 2, 1)
    # the train pool scores in layout.logprob and trains in layout.train (it switches between)
    cfg = _cfg(layout__train="tp2", layout__logprob="dp2", layout__rollout="dp1",
               rollout__pool_ranks=1)
    assert str(split_logprob_layout(cfg, 3)) == "DP2"
    with pytest.raises(ConfigError, match="layout.logprob=CP2: the train pool holds"):
        split_pools(_cfg(layout__logprob="cp2"), 4)


@pytest.mark.parametrize("over, says", [
    ({"algorithm__max_staleness": 0}, "algorithm.max_staleness >= 1"),
    ({"rollout__placement": "auto"}, "set layout.mode=auto"),
    ({"rollout__placement": "auto", "layout__mode": "auto", "rollout__pool_ranks": 1},
     "set rollout.placement=split"),
])
def test_what_split_does_not_run_is_refused_with_the_fix(over, says):
    with pytest.raises(ConfigError, match="split|placement") as e:
        _cfg(**over)
    assert says in str(e.value)


def test_pool_ranks_without_split_is_refused():
    with pytest.raises(ConfigError, match="rollout.placement=split"):
        TrainConfig.from_dict({"rollout": {"pool_ranks": 1}})


@pytest.mark.parametrize("over, world, says", [
    ({"rollout__pool_ranks": 4}, 4, "at least one rank"),
    ({"layout__rollout": "dp3"}, 4, "layout.rollout=dp3 on the rollout pool's 2 ranks"),
    ({"layout__train": "cp2", "layout__logprob": "cp2"}, 4, "cp > 1"),
    ({"rollout__episodes_per_iteration": 2}, 4, "fewer than the train pool's 2"),
])
def test_pools_that_cannot_run_on_the_world_are_refused(over, world, says):
    with pytest.raises(ConfigError) as e:
        split_pools(_cfg(**over), world)
    assert says in str(e.value)


def test_split_runs_sglang_servers_on_the_rollout_pool():
    """engine=sglang under split: the rollout pool's layout follows SGLang's rules (tp and dp
    only), checked against the pool's ranks."""
    cfg = _cfg(rollout__engine="sglang", rollout__sglang_device="cpu",
               layout__rollout="tp2", rollout__pool_ranks=2)
    t, r = split_pools(cfg, 4)
    assert (t.dp, r.tp) == (2, 2)
    cfg = _cfg(rollout__engine="sglang", rollout__sglang_device="cpu",
               layout__rollout="pp2", rollout__pool_ranks=2)
    with pytest.raises(ConfigError, match="layout.rollout=PP2"):
        split_pools(cfg, 4)


def test_auto_placement_takes_auto_layouts():
    cfg = _cfg(rollout__placement="auto", layout__mode="auto")
    assert cfg.rollout.placement == "auto"


@pytest.mark.parametrize("placement", ["auto", "split"])
def test_planned_placements_take_sglang_servers(placement):
    """A planned placement (auto, or split with auto layouts) moves SGLang servers by
    restarting them on the new rollout ranks (trainer/auto.py): no longer refused."""
    cfg = _cfg(rollout__placement=placement, layout__mode="auto", rollout__engine="sglang",
               rollout__sglang_device="cpu")
    assert (cfg.rollout.placement, cfg.layout.mode, cfg.rollout.engine) == \
        (placement, "auto", "sglang")


@pytest.mark.parametrize("over", [
    {"layout__mode": "auto"},                               # the selector lays out the pools
    {"layout__mode": "auto", "rollout__pool_ranks": 1},     # ... of the size given
    {"algorithm__kl_mode": "loss", "algorithm__kl_coef": 0.1},   # the reference on the train pool
    {"sft__steps": 4, "sft__data": "traces.jsonl"},         # warm start before the pools split
])
def test_what_split_now_composes_with(over):
    _cfg(**over)
