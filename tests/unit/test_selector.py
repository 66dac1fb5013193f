"""Selector: plans are valid, fit, are deterministic and stable under hysteresis; the error when
nothing fits names changes that were checked to fit; reshard bytes by hand."""

import re

import pytest
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.memory_model import param_count_per_rank
from earl_megatron.plan.presets import PRESETS
from earl_megatron.plan.reshard_plan import receive_bytes
from earl_megatron.plan.selector import (NoLayoutFitsError, Selector, SelectorConfig,
                                         SelectorState, select_layout, switch_seconds)
from earl_megatron.plan.memory_model import server_pool_fits
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.server_restart import model_key, push_seconds
from earl_megatron.plan.specs import (GiB, ClusterSpec, DecodeEngine, Recompute, Stage,
                                      StageWorkload, TrainOptions, human_bytes)

TINY = ModelConfig.tiny()
SMALL = ModelConfig.tiny(num_layers=8, hidden_size=512, ffn_hidden_size=2048, vocab_size=4096)

scenarios = st.one_of(
    st.tuples(st.sampled_from([TINY, SMALL, ModelConfig.tiny(family="qwen2",
                                                              tie_word_embeddings=True)]),
              st.builds(lambda r, mb: ClusterSpec.cpu(ranks=r, memory_budget_bytes=mb << 20),
                        st.sampled_from([1, 2, 4, 8]), st.integers(4, 2048))),
    st.tuples(st.sampled_from([PRESETS["llama3-8b"], PRESETS["qwen2.5-7b"]]),
              st.builds(ClusterSpec.h100_80gb, st.sampled_from([1, 2, 4]))),
)


@settings(max_examples=60, deadline=None)
@given(scenario=scenarios, stage=st.sampled_from(list(Stage)), ctx=st.integers(1, 40000),
       grow=st.integers(1, 40000), seqs=st.integers(1, 64), inflight=st.integers(1, 64),
       mb=st.sampled_from([512, 4096, 16384]), margin=st.sampled_from([0.0, 0.1, 0.3]))
def test_plans_are_valid_fit_deterministic_and_memory_grows_with_context(
        scenario, stage, ctx, grow, seqs, inflight, mb, margin):
    model, cluster = scenario
    sel = Selector(model, cluster, config=SelectorConfig(memory_margin=margin))
    wl = StageWorkload.of(stage, ctx, seqs, responses_in_flight=inflight, micro_batch_tokens=mb)
    try:
        plan, state = sel.plan(wl)
    except NoLayoutFitsError as e:
        # Refused only when every valid layout really exceeds the budget.
        assert all(sel.memory(lay, wl).total > sel.budget_bytes
                   for lay in sel.valid_layouts(stage))
        assert e.smallest is not None and e.smallest.total > sel.budget_bytes
        return
    plan.layout.check(cluster.world_size, model)
    assert plan.layout.world_size == cluster.world_size
    assert plan.predicted_memory_bytes <= cluster.device_memory_bytes * (1 - margin)
    assert plan.predicted_memory_bytes == sel.memory(plan.layout, wl).total
    assert state.previous(stage) == plan.layout
    assert sel.plan(wl) == (plan, state)                       # deterministic
    assert select_layout(model, cluster, wl, config=sel.config) == (plan, state)
    longer = wl.with_(contexts=((ctx + grow, seqs),))
    assert sel.memory(plan.layout, longer).total >= plan.predicted_memory_bytes
    if plan.runner_up is not None:
        assert (plan.chosen.cost, plan.chosen.memory.total, plan.layout) <= \
            (plan.runner_up.cost, plan.runner_up.memory.total, plan.runner_up.layout)


def _choice(sel: Selector, make, ctx: int) -> ParallelLayout:
    return sel.plan(make(ctx))[0].layout


def _boundary(sel: Selector, make, lo: int = 16, hi: int = 16384):
    """Adjacent context lengths (b - 1, b) where the choice without history changes."""
    prev_c, prev = lo, _choice(sel, make, lo)
    c = lo
    while c < hi:
        c *= 2
        now = _choice(sel, make, c)
        if now != prev:
            a, b = prev_c, c
            while b - a > 1:
                mid = (a + b) // 2
                if _choice(sel, make, mid) == prev:
                    a = mid
                else:
                    b = mid
            return a, b
        prev_c, prev = c, now
    return None


def _switches(sel: Selector, make, contexts) -> int:
    state, last, n = SelectorState(), None, 0
    for c in contexts:
        plan, state = sel.plan(make(c), state=state)
        n += last is not None and plan.layout != last
        last = plan.layout
    return n


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(model=st.sampled_from([TINY, SMALL]), world=st.sampled_from([2, 4, 8]),
       seqs=st.integers(1, 8), stage=st.sampled_from(list(Stage)), iterations=st.integers(6, 16))
def test_hysteresis_stops_flapping_on_an_oscillating_workload(model, world, seqs, stage,
                                                              iterations):
    cluster = ClusterSpec.cpu(ranks=world, memory_budget_bytes=64 * GiB)
    free = Selector(model, cluster, config=SelectorConfig(hysteresis=0.0))

    def make(ctx):
        return StageWorkload.of(stage, ctx, seqs, responses_in_flight=seqs)

    found = _boundary(free, make)
    assume(found is not None)
    a, b = found
    event(f"boundary found for {stage.value}")
    wave = [a, b] * (iterations // 2)
    # Without hysteresis the choice follows the workload every iteration (TRAIN may already be
    # held by the cost of moving its optimizer state) ...
    if stage is not Stage.TRAIN:
        assert _switches(free, make, wave) == len(wave) - 1
    # ... with it, the layout changes at most once.
    sticky = Selector(model, cluster, config=SelectorConfig(hysteresis=0.05))
    assert _switches(sticky, make, wave) <= 1


def test_hysteresis_keeps_and_explains():
    cluster = ClusterSpec.cpu(ranks=4, memory_budget_bytes=64 * GiB)
    sel = Selector(SMALL, cluster)
    wl = StageWorkload.of(Stage.LOGPROB, 64, 8)
    best, _ = sel.plan(wl)
    other = best.runner_up.layout
    state = SelectorState().with_choice(Stage.LOGPROB, other)
    gain = 1 - best.chosen.cost / best.runner_up.cost
    kept, state2 = Selector(SMALL, cluster, config=SelectorConfig(hysteresis=gain + 0.01)).plan(
        wl, state=state)
    assert kept.layout == other and kept.reason.startswith(f"kept {other}")
    assert state2.previous(Stage.LOGPROB) == other
    moved, _ = Selector(SMALL, cluster, config=SelectorConfig(hysteresis=gain / 2)).plan(
        wl, state=state)
    assert moved.layout == best.layout


def test_switch_is_priced_with_the_reshard_plans_own_bytes():
    """The selector's switch cost is the plan the switcher runs: regroup + the most any rank
    receives over the link (tests/unit/test_reshard_plan.py checks those bytes by hand and
    against the plan's transfers)."""
    cluster = ClusterSpec.cpu(ranks=4, memory_budget_bytes=64 * GiB)
    lays = Selector(TINY, cluster).valid_layouts(Stage.TRAIN)
    for a in lays:
        for b in lays:
            want = 0.0 if a == b else cluster.regroup_seconds + max(
                receive_bytes(TINY, a, b)) / cluster.intra_node_bandwidth
            assert switch_seconds(TINY, cluster, a, b) == pytest.approx(want), (a, b)


def test_switch_cost_counts_in_the_plan():
    cluster = ClusterSpec.cpu(ranks=4, memory_budget_bytes=64 * GiB)
    sel = Selector(SMALL, cluster)
    wl = StageWorkload.of(Stage.LOGPROB, 512, 8)
    for lay in sel.valid_layouts(Stage.LOGPROB):
        assert sel.evaluate(lay, wl, current=lay).switch_seconds == 0.0
    plans, state = sel.plan_iteration([wl.with_(stage=s) for s in Stage])
    assert plans[0].chosen.switch_seconds == 0.0                       # nothing live yet
    for prev, plan in zip(plans, plans[1:]):
        assert plan.chosen.switch_seconds == pytest.approx(switch_seconds(
            SMALL, cluster, prev.layout, plan.layout,
            optimizer_src=None))
    assert [p.layout for p in plans] == [state.previous(s) for s in Stage]
    assert all(p.layout.cp == 1 for p in plans if p.stage is Stage.ROLLOUT)


def test_optimizer_state_follows_a_train_layout_change():
    cluster = ClusterSpec.h100_80gb(nodes=1)
    model = PRESETS["llama3-8b"]
    a, b = ParallelLayout(tp=8), ParallelLayout(tp=4, dp=2)
    weights_only = switch_seconds(model, cluster, a, b)
    with_state = switch_seconds(model, cluster, a, b, optimizer_src=a)
    # dp*cp changes 1 -> 2: the whole new optimizer shard (12 B/param / 2) arrives.
    extra = param_count_per_rank(model, b, 0) * 12 / 2 / cluster.intra_node_bandwidth
    assert with_state == pytest.approx(weights_only + extra)


def test_no_layout_fits_names_checked_fixes():
    model = PRESETS["qwen2.5-72b"]
    cluster = ClusterSpec.h100_80gb(nodes=16)
    wl = StageWorkload.of(Stage.TRAIN, 65536, 16)
    sel = Selector(model, cluster)
    with pytest.raises(NoLayoutFitsError) as e:
        sel.plan(wl)
    msg = str(e.value)
    assert "no layout fits stage train in 67.1 GiB" in msg and "Would fit:" in msg
    nodes = [int(m) for m in re.findall(r"(\d+) nodes", msg)]
    assert nodes, msg
    bigger = Selector(model, cluster.with_(nodes=nodes[0]))
    assert bigger.plan(wl)[0].predicted_memory_bytes <= bigger.budget_bytes
    half = Selector(model, cluster.with_(nodes=nodes[0] // 2))
    with pytest.raises(NoLayoutFitsError):          # the smallest such count is suggested
        half.plan(wl)


def test_suggested_recompute_and_context_really_fit():
    model = PRESETS["llama3-8b"]
    cluster = ClusterSpec.h100_80gb(nodes=1)
    wl = StageWorkload.of(Stage.TRAIN, 262144, 8)
    sel = Selector(model, cluster)
    with pytest.raises(NoLayoutFitsError) as e:
        sel.plan(wl)
    sugg = " | ".join(e.value.suggestions)
    ctx = int(re.search(r"contexts up to (\d+) tokens", sugg).group(1))
    assert sel.plan(wl.scaled_to(ctx))[0].predicted_memory_bytes <= sel.budget_bytes
    with pytest.raises(NoLayoutFitsError):
        sel.plan(wl.scaled_to(ctx + 1))
    if "recompute=" in sugg:
        rc = Recompute(re.search(r"recompute=(\w+)", sugg).group(1))
        Selector(model, cluster, TrainOptions(recompute=rc)).plan(wl)


def test_rollout_max_pp_limits_only_the_rollout_stage():
    # SGLang servers take tp x dp layouts: the trainer sets rollout_max_pp=1 for that engine
    cluster = ClusterSpec.cpu(ranks=4, memory_budget_bytes=64 * GiB)
    free = Selector(SMALL, cluster)
    capped = Selector(SMALL, cluster, config=SelectorConfig(rollout_max_pp=1))
    assert any(lay.pp > 1 for lay in free.valid_layouts(Stage.ROLLOUT))
    rollout = capped.valid_layouts(Stage.ROLLOUT)
    assert rollout and all(lay.pp == 1 and lay.cp == 1 for lay in rollout)
    assert {(lay.tp, lay.dp) for lay in rollout} == {(1, 4), (2, 2), (4, 1)} & \
        {(lay.tp, lay.dp) for lay in free.valid_layouts(Stage.ROLLOUT)}
    assert capped.valid_layouts(Stage.TRAIN) == free.valid_layouts(Stage.TRAIN)


# ------------------------------------------------------------------ SGLang servers
SGL = ClusterSpec.cpu(ranks=4).with_(decode_engine=DecodeEngine.sglang_servers(0.5))
SGL_WL = StageWorkload.of(Stage.ROLLOUT, 256, 16, responses_in_flight=16)
DP4, TP4 = ParallelLayout(dp=4), ParallelLayout(tp=4)


def _sglang(restart_s: float, hysteresis: float = 0.0, profile=None) -> Selector:
    return Selector(SMALL, SGL, config=SelectorConfig(hysteresis=hysteresis,
                                                      server_restart_s=restart_s),
                    profile=profile)


def test_sglang_rollout_memory_is_weights_over_tp_plus_the_static_pool():
    sel = _sglang(60.0)
    assert all((lay.pp, lay.cp) == (1, 1) for lay in sel.valid_layouts(Stage.ROLLOUT))
    assert any(lay.pp > 1 for lay in sel.valid_layouts(Stage.TRAIN))
    with pytest.raises(ValueError, match="tp x dp"):
        sel.memory(ParallelLayout(pp=2, dp=2), SGL_WL)
    for lay in (DP4, TP4):
        m = sel.memory(lay, SGL_WL)
        w = param_count_per_rank(SMALL, lay, 0) * 4
        assert m.server_weights == m.weights == w                 # the server's copy: w / tp
        # the pool fills the device to the fraction, whatever the responses need
        assert m.kv_cache == int(2 * GiB * 0.5) - (m.weights + m.server_weights)
        one = sel.memory(lay, SGL_WL.with_(responses_in_flight=1, contexts=((256, 1),)))
        assert one.kv_cache == m.kv_cache
        # bytes already on the device shrink the pool, not the total
        held = sel.memory(lay, SGL_WL, resident_bytes=10 << 20)
        assert held.kv_cache == m.kv_cache - (10 << 20) and held.total == m.total
        assert sel.fits(m)
    tp4, dp4 = sel.memory(TP4, SGL_WL), sel.memory(DP4, SGL_WL)
    assert tp4.server_weights < dp4.server_weights / 3.5        # tp splits all but the norms
    # the embedded engine's static cache instead holds every response at its longest context
    emb = Selector(SMALL, ClusterSpec.cpu(ranks=4)).memory(TP4, SGL_WL)
    assert emb.server_weights == 0 and emb.kv_cache == 16 * (emb.kv_cache // 16)
    assert emb.kv_cache < tp4.kv_cache


def test_sglang_pool_smaller_than_one_sequence_does_not_fit():
    tight = replace_engine(0.04)   # 82 MiB: holds TP4's two weight copies (68 MiB), not DP4's
    m = tight.memory(DP4, SGL_WL)
    assert m.total <= tight.budget_bytes and not server_pool_fits(m, tight.cluster)
    assert not tight.fits(m) and tight.fits(tight.memory(TP4, SGL_WL))
    plan, _ = tight.plan(SGL_WL)
    assert plan.layout.tp > 1 and DP4 in plan.oom
    with pytest.raises(NoLayoutFitsError):
        replace_engine(0.001).plan(SGL_WL)


def replace_engine(fraction: float) -> Selector:
    return Selector(SMALL, SGL.with_(decode_engine=DecodeEngine.sglang_servers(fraction)))


def test_sglang_restart_is_priced_against_the_gain_and_kept_under_it():
    push = push_seconds(SMALL, SGL)
    # gather the full fp32 model, broadcast it to the server
    assert push == 2 * 4 * param_count_per_rank(SMALL, ParallelLayout(), 0) / 1.5e9
    live = SelectorState().with_choice(Stage.ROLLOUT, TP4)        # servers run in TP4
    base = _sglang(0.0)
    inc, alt = base.evaluate(TP4, SGL_WL, state=live), base.evaluate(DP4, SGL_WL, state=live)
    gain = inc.predicted_seconds - alt.predicted_seconds
    assert inc.switch_seconds == 0.0 and gain > push             # the servers stay: no cost
    for restart, kept in ((gain - push - 0.05, False), (gain - push + 0.05, True), (60.0, True)):
        plan, state = _sglang(restart).plan(SGL_WL, state=live)
        assert plan.chosen.switch_seconds == (0.0 if kept else pytest.approx(restart + push))
        assert plan.layout == (TP4 if kept else DP4), (restart, gain, plan.reason)
        assert state.previous(Stage.ROLLOUT) == plan.layout
    # the reason shows the alternative's cost with its restart
    assert f"{alt.predicted_seconds + 60 + push:.3g} s for DP4" in \
        _sglang(60.0).plan(SGL_WL, state=live)[0].reason
    # hysteresis still applies: a free restart that gains under 5% keeps the servers
    assert gain + 1e-9 < 0.05 * inc.predicted_seconds + push
    assert _sglang(0.0, hysteresis=0.05).plan(SGL_WL, state=live)[0].layout == TP4
    # the Megatron reshard of the trainer's copy is counted on top of the restart
    sw = _sglang(7.0).evaluate(DP4, SGL_WL, current=TP4, state=live).switch_seconds
    assert sw == pytest.approx(switch_seconds(SMALL, SGL, TP4, DP4) + 7.0 + push)


def test_a_measured_restart_replaces_the_default():
    live = SelectorState().with_choice(Stage.ROLLOUT, TP4)
    key = model_key(SMALL)
    fast = ProfileTable().record_restart(key, 1, 0.01)            # DP4's servers are tp1
    slow = ProfileTable().record_restart(key, 1, 60.0)
    assert _sglang(60.0).plan(SGL_WL, state=live)[0].layout == TP4            # default: kept
    assert _sglang(60.0, profile=fast).plan(SGL_WL, state=live)[0].layout == DP4
    assert _sglang(0.0).plan(SGL_WL, state=live)[0].layout == DP4             # default: moves
    # tp1 measured slow: the free (default 0 s) TP2xDP2 restart wins; both slow: kept
    assert _sglang(0.0, profile=slow).plan(SGL_WL, state=live)[0].layout == \
        ParallelLayout(tp=2, dp=2)
    slow = slow.record_restart(key, 2, 60.0)
    assert _sglang(0.0, profile=slow).plan(SGL_WL, state=live)[0].layout == TP4
    # a measurement of another tp or another model does not count for tp1 of this model
    other = ProfileTable().record_restart(key, 4, 0.01).record_restart("x", 1, 0.01)
    assert _sglang(60.0, profile=other).plan(SGL_WL, state=live)[0].layout == TP4


# ------------------------------------------------------------------ recompute as a choice
AUTO = SelectorConfig(auto_recompute=True)


@settings(max_examples=40, deadline=None)
@given(scenario=scenarios, ctx=st.integers(64, 40000), seqs=st.integers(1, 64),
       mb=st.sampled_from([512, 4096, 16384]))
def test_auto_recompute_picks_the_cheapest_fitting_pair(scenario, ctx, seqs, mb):
    """TRAIN under auto: the plan is the least-cost fitting (layout, mode) pair, none whenever
    it fits and is fastest; it fits wherever any fixed mode fits; its memory is its mode's."""
    model, cluster = scenario
    wl = StageWorkload.of(Stage.TRAIN, ctx, seqs, micro_batch_tokens=mb)
    auto = Selector(model, cluster, config=AUTO)
    fixed = {}
    for rc in Recompute:
        try:
            fixed[rc] = Selector(model, cluster, TrainOptions(recompute=rc)).plan(wl)[0]
        except NoLayoutFitsError:
            pass
    if not fixed:
        with pytest.raises(NoLayoutFitsError) as e:
            auto.plan(wl)
        assert not any(s.startswith("recompute=") for s in e.value.suggestions)
        return
    plan = auto.plan(wl)[0]
    assert plan.chosen.cost <= min(p.chosen.cost for p in fixed.values()) + 1e-12
    assert plan.predicted_memory_bytes == auto.memory(plan.layout, wl, 0, plan.recompute).total
    assert plan.predicted_memory_bytes <= auto.budget_bytes
    if Recompute.NONE in fixed and fixed[Recompute.NONE].chosen.cost <= plan.chosen.cost:
        assert plan.recompute is Recompute.NONE and plan.layout == fixed[Recompute.NONE].layout
    assert f"recompute={plan.recompute.value}" in plan.reason


def test_auto_recompute_moves_to_full_as_contexts_grow_and_back():
    # llama3-8b on one H100 node: none fits at 8K, only recomputation at 64K
    model, cluster = PRESETS["llama3-8b"], ClusterSpec.h100_80gb(nodes=1)
    sel = Selector(model, cluster, config=AUTO)
    short, long_ = (StageWorkload.of(Stage.TRAIN, n, 8) for n in (8192, 65536))
    p1, state = sel.plan(short)
    p2, state = sel.plan(long_, state=state)
    p3, _ = sel.plan(short, state=state)
    assert p1.recompute is Recompute.NONE and p3.recompute is Recompute.NONE
    assert p2.recompute is not Recompute.NONE
    with pytest.raises(NoLayoutFitsError):
        Selector(model, cluster).plan(long_)                   # recompute=none: nothing fits
    # the reason names the mode, its seconds, and the other modes on that layout
    none = sel.memory(p2.layout, long_, 0, Recompute.NONE)
    assert f"recompute={p2.recompute.value} ({p2.predicted_seconds:.3g} s; none needs " \
           f"{human_bytes(none.total)}, over the budget" in p2.reason, p2.reason


def test_auto_recompute_skips_a_mode_that_saves_nothing():
    # over flash attention (h100) selective keeps what none keeps: never a separate candidate
    model, cluster = PRESETS["llama3-8b"], ClusterSpec.h100_80gb(nodes=1)
    plan = Selector(model, cluster, config=AUTO).plan(StageWorkload.of(Stage.TRAIN, 4096, 8))[0]
    assert plan.runner_up.recompute is not Recompute.SELECTIVE
    cpu = Selector(SMALL, ClusterSpec.cpu(ranks=2, memory_budget_bytes=64 * GiB), config=AUTO)
    wl = StageWorkload.of(Stage.TRAIN, 512, 4)
    assert cpu.memory(ParallelLayout(), wl, 0, Recompute.SELECTIVE).total < \
        cpu.memory(ParallelLayout(), wl, 0, Recompute.NONE).total       # unfused: it saves
