"""Split placement's plan (plan/split.py): pools, the period, auto's choice, hysteresis, rates.

The CPU cluster's ranks share its cores (every rank gets cores / ranks of a core whichever pool
it is in), so splitting compute between pools cannot beat colocated there; what a split
overlaps is the time the environments take. The tests lean on that: without environment time
auto stays colocated, with environment time as long as the compute it splits.
"""

from dataclasses import replace

import pytest

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.memory_model import memory_breakdown
from earl_megatron.plan.presets import get_preset
from earl_megatron.plan.selector import Selector, SelectorConfig
from earl_megatron.plan.specs import ClusterSpec, DecodeEngine, Stage, StageWorkload, TrainOptions
from earl_megatron.plan.split import (MeasuredRates, SplitDoesNotFitError, SplitWorkload,
                                      env_seconds, handoff_seconds, move_seconds, plan_split,
                                      pool_cluster, scored_rates, split_choices)
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.weight_plan import ShardsIn, plan_weights

TINY = ModelConfig.tiny(vocab_size=32)


def _work(length=200, episodes=16, env_s=0.0) -> SplitWorkload:
    return SplitWorkload(*(StageWorkload.of(s, length, episodes, responses_in_flight=episodes)
                           for s in (Stage.ROLLOUT, Stage.LOGPROB, Stage.TRAIN)),
                         env_seconds=env_s)


def _cpu(ranks=4, **kw) -> Selector:
    return Selector(TINY, ClusterSpec.cpu(ranks=ranks, **kw), TrainOptions())


def test_pool_clusters_are_part_of_a_node_or_whole_nodes():
    h = ClusterSpec.h100_80gb(nodes=4)
    assert pool_cluster(h, 3).world_size == 3 and pool_cluster(h, 3).nodes == 1
    assert pool_cluster(h, 16).nodes == 2 and pool_cluster(h, 16).devices_per_node == 8
    assert pool_cluster(h, 16).peak_flops == h.peak_flops    # the same devices, fewer
    for bad in (0, 12, 40):
        with pytest.raises(ValueError, match="whole nodes"):
            pool_cluster(h, bad)
    assert split_choices(h) == (8, 16, 24)
    assert split_choices(ClusterSpec.cpu(ranks=4)) == (1, 2, 3)


def test_a_fixed_split_plans_each_pool_on_its_own_ranks():
    sel = _cpu()
    plan = plan_split(sel, _work(env_s=0.3), rollout_ranks=2)
    assert (plan.rollout_ranks, plan.train_ranks) == (2, 2) and not plan.colocated
    assert plan.rollout.layout.world_size == 2
    assert plan.logprob.layout.world_size == plan.train.layout.world_size == 2
    for p in (plan.rollout, plan.logprob, plan.train):
        assert p.predicted_memory_bytes <= sel.budget_bytes
    assert plan.period_s == pytest.approx(max(plan.rollout_s, plan.train_s) + plan.handoff_s)
    assert plan.rollout_s == pytest.approx(plan.rollout.chosen.cost + 0.3)
    assert plan.reason.startswith("fixed split: 2 rollout")
    assert plan_split(sel, _work(), rollout_ranks=0).reason.startswith("colocated: colocated on 4")
    assert plan_split(sel, _work(env_s=0.3), rollout_ranks=2) == plan     # deterministic
    colo = plan_split(sel, _work(env_s=0.3), rollout_ranks=0)
    assert colo.colocated and colo.handoff_s == 0 and colo.train_ranks == 4
    assert colo.period_s == pytest.approx(colo.rollout_s + colo.train_s)


def test_the_handoff_is_the_weight_plans_transfer():
    sel = _cpu()
    train, rollout = ParallelLayout(dp=2), ParallelLayout(tp=2)
    plan = plan_weights(TINY, train, [ShardsIn(rollout, (2, 3))], bucket_bytes=1 << 29,
                        world_size=4)
    nbytes = max(plan.recv_bytes())
    assert nbytes > 0 and plan.recv_bytes()[0] == plan.recv_bytes()[1] == 0
    c = sel.cluster
    s = handoff_seconds(sel, train, rollout)
    assert s == pytest.approx(nbytes / c.intra_node_bandwidth
                              + len(plan.buckets) * c.intra_node_latency_s)
    servers = replace(sel, cluster=c.with_(decode_engine=DecodeEngine.sglang_servers(0.5)))
    # servers: the whole model at each replica's leader, i.e. twice a tp2 shard's bytes
    assert handoff_seconds(servers, train, rollout) > s


def test_auto_takes_the_fastest_of_colocated_and_every_split():
    sel = _cpu()
    colo = plan_split(sel, _work(), rollout_ranks=0)
    # environment time as long as the colocated compute: overlapping it pays
    work = _work(env_s=colo.period_s)
    auto = plan_split(sel, work)
    fixed = [plan_split(sel, work, rollout_ranks=n) for n in (0, 1, 2, 3)]
    assert auto.period_s == min(p.period_s for p in fixed)
    assert not auto.colocated and "fastest of 4 splits" in auto.reason, auto.reason
    assert auto.period_s < 0.8 * fixed[0].period_s
    # a handoff that costs more than any overlap saves: colocated
    slow = replace(sel, cluster=sel.cluster.with_(intra_node_bandwidth=1e3))
    assert plan_split(slow, work).colocated


def test_measured_rates_scale_each_side_and_move_the_split():
    sel = _cpu()
    work = _work(env_s=0.5)
    ran = plan_split(sel, work, rollout_ranks=2)
    # the rollout took 3x what the model says, the train side what it says
    rates = MeasuredRates(2, 3 * ran.rollout_s, 3200, ran.train_s, 3200)
    scaled = plan_split(sel, work, rollout_ranks=2, rates=rates)
    assert scaled.rollout_s == pytest.approx(3 * ran.rollout_s)
    assert scaled.train_s == pytest.approx(ran.train_s)
    auto = plan_split(sel, work, rates=rates)
    plain = plan_split(sel, work)
    assert auto.rollout_ranks > plain.rollout_ranks or plain.colocated, (auto.reason, plain.reason)
    assert "measured" in auto.reason and "tokens/s/rank" in auto.reason
    r, t = rates.per_rank(4)
    assert r == pytest.approx(3200 / (3 * ran.rollout_s) / 2)


def test_hysteresis_keeps_the_split_unless_the_gain_pays_the_move():
    sel = _cpu()
    colo = plan_split(sel, _work(), rollout_ranks=0)
    work = _work(env_s=colo.period_s)
    best = plan_split(sel, work)
    others = [plan_split(sel, work, rollout_ranks=n) for n in (1, 2, 3)
              if n != best.rollout_ranks]
    near = min(others, key=lambda p: p.period_s)
    gain = 1 - best.period_s / near.period_s
    kept = plan_split(sel, work, current=near, hysteresis=min(0.99, gain + 0.05))
    assert kept.rollout_ranks == near.rollout_ranks and kept.reason.startswith("kept")
    moved = plan_split(sel, work, current=near, hysteresis=0.0)
    assert moved.rollout_ranks == best.rollout_ranks
    assert move_seconds(sel, near, best) > 0 == move_seconds(sel, best, best)


def test_a_measured_move_spread_over_the_iterations_left_decides_it():
    sel = _cpu()
    colo = plan_split(sel, _work(), rollout_ranks=0)
    work = _work(env_s=colo.period_s)
    best = plan_split(sel, work)
    near = min((plan_split(sel, work, rollout_ranks=n) for n in (0, 1, 2, 3)
                if n != best.rollout_ranks), key=lambda p: p.period_s)
    gain = near.period_s * (1 - sel.config.hysteresis) - best.period_s   # per iteration
    assert gain > move_seconds(sel, near, best)
    # a move measured at 3 iterations' gain: worth it over 4 iterations left, not over 2
    moved_s = 3 * gain
    kept = plan_split(sel, work, current=near, moved_s=moved_s, horizon=2)
    assert kept.rollout_ranks == near.rollout_ranks
    assert f"move {moved_s:.3g} s over 2 iterations" in kept.reason
    assert plan_split(sel, work, current=near, moved_s=moved_s,
                      horizon=4).rollout_ranks == best.rollout_ranks
    for bad in ({"horizon": 0}, {"moved_s": -1.0}):
        with pytest.raises(ValueError, match="horizon >= 1 and moved_s >= 0"):
            plan_split(sel, work, current=near, **bad)


def test_scored_rates_scale_the_train_side_by_the_measured_scoring():
    sel = _cpu(ranks=3)
    work = _work(env_s=0.2)
    colo = plan_split(sel, work, rollout_ranks=0)
    # scoring took twice the model's LOGPROB: the whole train side (LOGPROB + TRAIN) is
    # taken to be twice the model's; the rollout as measured
    rates = scored_rates(sel, work, 0.9, 2 * colo.logprob.chosen.cost, 3200)
    assert (rates.rollout_ranks, rates.rollout_seconds, rates.rollout_tokens) == (0, 0.9, 3200)
    assert rates.train_seconds == pytest.approx(2 * colo.train_s)
    scaled = plan_split(sel, work, rollout_ranks=0, rates=rates)
    assert scaled.train_s == pytest.approx(2 * colo.train_s)
    assert scaled.rollout_s == pytest.approx(0.9)
    with pytest.raises(ValueError, match="measured scoring time > 0"):
        scored_rates(sel, work, 0.9, 0.0, 3200)


def test_a_pool_that_does_not_fit_is_named():
    # a budget with room for a DP2 shard of the training state but not for the whole of it
    model = ModelConfig.tiny(num_layers=8, hidden_size=512, ffn_hidden_size=2048,
                             num_attention_heads=8, num_query_groups=8, vocab_size=1024)
    opts = TrainOptions(distributed_optimizer=True)
    one = memory_breakdown(model, ParallelLayout(), StageWorkload.of(Stage.TRAIN, 64, 1), opts)
    sel = Selector(model, ClusterSpec.cpu(ranks=4, memory_budget_bytes=int(one.total * 0.8)),
                   opts, SelectorConfig(memory_margin=0.0))
    work = SplitWorkload(*(StageWorkload.of(s, 64, 4, responses_in_flight=4)
                           for s in (Stage.ROLLOUT, Stage.LOGPROB, Stage.TRAIN)))
    with pytest.raises(SplitDoesNotFitError, match="the train pool of 1 ranks: no layout fits"):
        plan_split(sel, work, rollout_ranks=3)
    assert plan_split(sel, work, rollout_ranks=2).train_ranks == 2


def test_servers_alone_on_their_devices_hold_no_trainer_weights():
    m = get_preset("qwen2.5-72b")
    lay = ParallelLayout(tp=8, dp=2)
    wl = StageWorkload.of(Stage.ROLLOUT, 32768, 64, responses_in_flight=64)
    beside = ClusterSpec.h100_80gb(nodes=2).with_(decode_engine=DecodeEngine.sglang_servers(0.5))
    alone = beside.with_(decode_engine=replace(beside.decode_engine, beside_trainer=False))
    a = memory_breakdown(m, lay, wl, TrainOptions(), cluster=beside)
    b = memory_breakdown(m, lay, wl, TrainOptions(), cluster=alone)
    assert a.weights == a.server_weights > 0 and b.weights == 0
    # the pool takes what the trainer's weights left (in whole pages of sequences)
    assert a.kv_cache + 0.9 * a.weights < b.kv_cache <= a.kv_cache + a.weights


def test_the_72b_recipe_at_32k_fits_only_split():
    m = get_preset("qwen2.5-72b")
    cluster = ClusterSpec.h100_80gb(nodes=16).with_(
        decode_engine=DecodeEngine.sglang_servers(0.5))
    sel = Selector(m, cluster, TrainOptions(distributed_optimizer=True),
                   SelectorConfig(auto_recompute=True))
    work = SplitWorkload(*(StageWorkload.of(s, 32768, 512, responses_in_flight=512,
                                            micro_batch_tokens=32768)
                           for s in (Stage.ROLLOUT, Stage.LOGPROB, Stage.TRAIN)))
    with pytest.raises(SplitDoesNotFitError, match="colocated: no layout fits stage rollout"):
        plan_split(sel, work, rollout_ranks=0)
    plan = plan_split(sel, work)
    assert not plan.colocated and plan.rollout_ranks % 8 == 0, plan.reason


def test_workload_and_rates_are_checked():
    w = _work()
    with pytest.raises(ValueError, match="SplitWorkload.rollout is a train workload"):
        SplitWorkload(w.train, w.logprob, w.train)
    with pytest.raises(ValueError, match="env_seconds"):
        replace(w, env_seconds=-1)
    with pytest.raises(ValueError, match="rollout_ranks >= 0"):
        MeasuredRates(-1, 1.0, 1, 1.0, 1)


def test_a_run_under_auto_placement_weighs_only_splits():
    """rollout.placement=auto's loop is the split one: its plans never pick colocated, even
    where colocated would be faster (no environment time to overlap)."""
    sel = _cpu()
    slow = replace(sel, cluster=sel.cluster.with_(intra_node_bandwidth=1e3))
    assert plan_split(slow, _work()).colocated   # a dear handoff: colocated is the fastest
    plan = plan_split(slow, _work(), colocated=False)
    assert plan.rollout_ranks in (1, 2, 3) and "of 3 splits" in plan.reason


def test_sglang_servers_start_once_per_move_not_every_period():
    """Servers (SGLang): a placement the run is not in pays its servers' start once, in the
    move (move_seconds: the restart on the new rollout ranks), never in its period; measured
    rates scale the steady state alone."""
    c = ClusterSpec.cpu(ranks=4).with_(decode_engine=DecodeEngine.sglang_servers(0.5))
    sel = Selector(TINY, c, TrainOptions(), SelectorConfig(server_restart_s=60.0))
    work = _work(env_s=0.2)
    one, colo = plan_split(sel, work, rollout_ranks=1), plan_split(sel, work, rollout_ranks=0)
    stay = plan_split(sel, work, rollout_ranks=1, current=one)   # servers already there
    assert one.rollout_s == pytest.approx(stay.rollout_s) and one.rollout_s < 60
    assert colo.period_s < 60 and one.period_s < 60
    # every move restarts the servers on other ranks: 60 s on top of the train state's move
    for src, dst in ((one, colo), (colo, one)):
        assert 60 < move_seconds(sel, src, dst) < 61, (src.reason, dst.reason)
    plain = _cpu()
    assert move_seconds(plain, plan_split(plain, work, rollout_ranks=1),
                        plan_split(plain, work, rollout_ranks=0)) < 1
    # the rollout measured 2x the model's steady state: the factor is 2, not 2 / (1 + 60 s)
    rates = MeasuredRates(1, 2 * one.rollout_s, 3200, one.train_s, 3200)
    assert plan_split(sel, work, rollout_ranks=1, rates=rates).rollout_s == \
        pytest.approx(2 * one.rollout_s)


def test_env_seconds_is_the_stage_less_its_decoding():
    assert env_seconds(3.0, {"rollout_decode_s": 1.25}) == 1.75
    assert env_seconds(3.0, {}) == 0.0                        # nothing apart: all decoding
    assert env_seconds(1.0, {"rollout_decode_s": 1.5}) == 0.0  # clocks differ: never < 0


def test_a_critic_is_counted_where_the_policy_trains():
    """ppo (SplitWorkload.critic): each train-pool candidate carries a critic's train state in
    its own layout (plan/critic_memory.py ``beside_train_state``), the rollout pool none;
    colocated, every stage carries it."""
    from earl_megatron.plan.critic_memory import train_bytes

    sel = _cpu()
    for ranks in (2, 0):
        plain = plan_split(sel, _work(), rollout_ranks=ranks)
        ppo = plan_split(sel, replace(_work(), critic=True), rollout_ranks=ranks)
        assert ppo.train.layout == plain.train.layout   # the tiny model fits either way
        extra = train_bytes(TINY, ppo.train.layout, sel.train_opts)
        assert extra > 0
        assert ppo.train.predicted_memory_bytes == plain.train.predicted_memory_bytes + extra
        lay = ppo.rollout.layout
        beside = train_bytes(TINY, lay, sel.train_opts) if ranks == 0 else 0
        assert ppo.rollout.predicted_memory_bytes == \
            plain.rollout.predicted_memory_bytes + beside, ranks
