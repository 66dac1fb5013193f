"""StagePlanner with rollout.engine=sglang: the selector plans the servers it will start (the
same memory fraction as their command line), prices restarts with the measured starts it is
given, keeps them across a checkpoint, and refuses static layouts the servers cannot take."""

import json

import pytest

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.train import (SGLANG_MEM_FRACTION, ConfigError, LayoutConfig,
                                        TrainConfig, sglang_kv_tokens, sglang_mem_fraction)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.server_restart import model_key
from earl_megatron.plan.specs import Stage
from earl_megatron.rollout.sglang_launch import SGLangConfig, server_command
from earl_megatron.trainer.planner import StagePlanner
from earl_megatron.trainer.stages import BatchShape

MODEL = ModelConfig.tiny(vocab_size=32)


def _planner(layout=LayoutConfig(), frac=0.05, restart_s=60.0) -> StagePlanner:
    return StagePlanner(MODEL, layout, ClusterConfig(), 2, distributed_optimizer=True,
                        episodes=4, batch=BatchShape(2), sglang_mem_fraction=frac,
                        sglang_restart_s=restart_s)


def _flag(cmd: list[str]) -> float:
    return float(cmd[cmd.index("--mem-fraction-static") + 1])


def test_one_memory_fraction_for_the_servers_and_the_selector():
    cfg = TrainConfig.from_dict({"rollout": {"engine": "sglang", "sglang_device": "cpu"}})
    frac = sglang_mem_fraction(cfg.rollout.sglang_mem_fraction, cfg.rollout.sglang_device)
    assert frac == SGLANG_MEM_FRACTION["cpu"] == 0.05
    engine = _planner(frac=frac).selector.cluster.decode_engine
    assert engine.servers and engine.memory_fraction == frac
    cmd = server_command(SGLangConfig(python="py", model_path="m", device="cpu",
                                      mem_fraction_static=frac), 0, 1234, "m")
    assert _flag(cmd) == frac
    # the engine's own CPU default is the same table entry
    assert _flag(server_command(SGLangConfig(python="py", model_path="m", device="cpu"), 0,
                                1234, "m")) == frac
    assert sglang_mem_fraction(0.3, "cuda") == 0.3 and sglang_mem_fraction(None, "cuda") == 0.8
    with pytest.raises(ConfigError, match="sglang_mem_fraction"):
        TrainConfig.from_dict({"rollout": {"sglang_mem_fraction": 1.2}})
    with pytest.raises(ConfigError, match="sglang_restart_s"):
        TrainConfig.from_dict({"rollout": {"sglang_restart_s": -1}})


def test_cpu_servers_cap_their_kv_pool_at_the_rollouts_worst_case():
    # cpu: (k+1) x episodes (or the evaluation's, if more) sequences of the context bound
    assert sglang_kv_tokens("cpu", 2 * 16, 512) == 16384
    assert sglang_kv_tokens("cpu", 0, 512) == 512
    assert sglang_kv_tokens("cuda", 32, 512) is None  # the fraction alone sizes a GPU's pool
    cmd = server_command(SGLangConfig(python="py", model_path="m", device="cpu",
                                      max_total_tokens=16384), 0, 1234, "m")
    assert cmd[cmd.index("--max-total-tokens") + 1] == "16384"
    assert "--max-total-tokens" not in server_command(
        SGLangConfig(python="py", model_path="m", device="cpu"), 0, 1234, "m")


def test_embedded_planner_keeps_the_embedded_engine():
    p = StagePlanner(MODEL, LayoutConfig(), ClusterConfig(), 2, distributed_optimizer=True,
                     episodes=4, batch=BatchShape(2))
    assert not p.selector.cluster.decode_engine.servers
    assert p.selector.cluster.decode_engine.name == "embedded"


def test_recorded_starts_price_restarts_and_survive_a_checkpoint():
    p = _planner(restart_s=1e6)   # default: no restart ever pays off
    first = p.plan("rollout", [128] * 4, None)
    assert (first.pp, first.cp) == (1, 1)
    other = next(lay for lay in p.selector.valid_layouts(Stage.ROLLOUT)
                 if (lay.tp, lay.dp) != (first.tp, first.dp))
    wl = p._workload("rollout", [128] * 4)
    assert p.selector.evaluate(other, wl, state=p.state).switch_seconds > 1e6
    p.record_start(other.tp, 2.5)
    assert p.selector.profile.restart_seconds(model_key(MODEL), other.tp) == 2.5
    priced = p.selector.evaluate(other, wl, state=p.state).switch_seconds
    assert 2.5 < priced < 3.0                                     # 2.5 s + one push
    saved = json.loads(json.dumps(p.profile_json()))              # what loop.json holds
    q = _planner(restart_s=1e6)
    q.restore(p.state_json(), [128] * 4, saved)
    assert q.selector.profile == p.selector.profile
    assert q.selector.evaluate(other, wl, state=q.state).switch_seconds == priced


def test_static_layouts_the_servers_cannot_take_are_refused():
    with pytest.raises(ConfigError, match=r"layout.rollout=pp2: PP2 has pp=2, but SGLang servers take tp x dp.*use e.g. tp2"):
        _planner(LayoutConfig(mode="static", rollout="pp2", logprob="dp2", train="dp2")).plan(
            "rollout", [64] * 4, None)
    tiny_pool = _planner(LayoutConfig(mode="static", rollout="dp2", logprob="dp2", train="dp2"),
                         frac=1e-5)
    with pytest.raises(ConfigError, match="cannot hold one 64-token sequence.*sglang_mem_frac"):
        tiny_pool.plan("rollout", [64] * 4, None)
    ok = _planner(LayoutConfig(mode="static", rollout="tp2", logprob="dp2", train="dp2"))
    assert ok.plan("rollout", [64] * 4, None) == ParallelLayout(tp=2)
    with pytest.raises(ConfigError, match="leaves nothing under layout.memory_margin=0.1"):
        _planner(frac=0.95)


def test_one_cluster_mapping_honours_the_node_size_and_the_world():
    # a 1-node, 4-GPU h100 job: the trainer's planner, plan_layouts and cluster_spec agree on
    # one 4-device node (before: the trainer planned on an 8-GPU node whatever the world)
    import argparse

    from earl_megatron.plan.specs import cluster_spec
    from tools.plan_layouts import build_parser, cluster_from_args

    big = ModelConfig.tiny(vocab_size=32)
    p = StagePlanner(big, LayoutConfig(), ClusterConfig(preset="h100"), 4,
                     distributed_optimizer=True, episodes=8, batch=BatchShape(2))
    spec = p.selector.cluster
    assert (spec.nodes, spec.devices_per_node, spec.world_size) == (1, 4, 4)
    assert spec.name.startswith("1x4 H100")
    args = build_parser().parse_args(["--nodes", "1", "--gpus-per-node", "4"])
    assert isinstance(args, argparse.Namespace)
    assert cluster_from_args(args) == spec == cluster_spec("h100", nodes=1, devices_per_node=4)
    lay = p.plan("train", [64] * 8, None)
    assert lay.world_size == 4
    # two nodes of 2 (cluster.devices_per_node given) and the memory budget carried through
    two = StagePlanner(big, LayoutConfig(memory_budget_gb=40), ClusterConfig(
        preset="h100", nodes=2, devices_per_node=2), 4, distributed_optimizer=True,
        episodes=8, batch=BatchShape(2)).selector.cluster
    assert (two.nodes, two.devices_per_node, two.device_memory_bytes) == (2, 2, 40 * 1024 ** 3)
    with pytest.raises(ConfigError, match="cluster.preset.*'tpu'"):
        StagePlanner(big, LayoutConfig(), ClusterConfig(preset="tpu"), 4,
                     distributed_optimizer=True, episodes=8, batch=BatchShape(2))


def _budget_planner(recompute: str, mode: str = "auto", budget_gb: float = 0.03) -> StagePlanner:
    """The demo's tiny model on 4 CPU ranks under a tight budget (as docs/selector.md's run)."""
    layout = LayoutConfig(mode=mode, memory_budget_gb=budget_gb, recompute=recompute,
                          **({"rollout": "dp4", "logprob": "dp4", "train": "cp4"}
                             if mode == "static" else {}))
    return StagePlanner(ModelConfig.tiny(vocab_size=32), layout, ClusterConfig(), 4,
                        distributed_optimizer=True, episodes=64, batch=BatchShape(4, 2048))


def test_layout_recompute_auto_moves_train_to_recompute_and_back():
    from earl_megatron.plan.selector import NoLayoutFitsError

    short, long_ = [100] * 64, [250] * 32 + [500] * 32
    p = _budget_planner("auto")
    modes = []
    for lengths in (short, long_, short):
        p.plan("train", lengths, None)
        modes.append(p.recompute["train"])
        assert f"recompute={modes[-1]}" in p.reasons["train"]
    assert modes[0] == modes[2] == "none" and modes[1] != "none", modes
    with pytest.raises(NoLayoutFitsError, match="recompute=selective"):
        _budget_planner("none").plan("train", long_, None)          # fixed: the error says so
    fixed = _budget_planner("full")
    fixed.plan("train", short, None)
    assert fixed.recompute["train"] == "full"
    # a static layout gets its fastest fitting mode under auto
    static = _budget_planner("auto", mode="static")
    assert static.plan("train", long_, None) == ParallelLayout.parse("cp4", 4)
    assert static.recompute["train"] != "none"
    static.plan("train", short, None)
    assert static.recompute["train"] == "none"
    with pytest.raises(ConfigError, match="layout.recompute='some'"):
        LayoutConfig(recompute="some")
