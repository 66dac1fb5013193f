"""ParallelLayout: validation errors, rank arithmetic against Megatron-Core's RankGenerator."""

import pytest
from hypothesis import given, strategies as st

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import InvalidLayoutError, ParallelLayout, enumerate_layouts

TINY = ModelConfig(num_layers=4, num_attention_heads=8, num_query_groups=4, vocab_size=128,
                   hidden_size=64, ffn_hidden_size=128)


@pytest.mark.parametrize("kwargs,axis,needle", [
    (dict(tp=3), "dp", "does not divide world size 8"),
    (dict(tp=8), "tp", "num_query_groups=4"),
    (dict(pp=8), "pp", "exceeds num_layers=4"),
])
def test_invalid_layouts_name_axis_and_fix(kwargs, axis, needle):
    with pytest.raises(InvalidLayoutError) as e:
        ParallelLayout.create(8, TINY, **kwargs)
    assert e.value.axis == axis
    assert needle in str(e.value)
    assert "Fix:" in str(e.value)


def test_product_mismatch_and_vocab():
    with pytest.raises(InvalidLayoutError, match="!= world size 4") as e:
        ParallelLayout(tp=2, dp=4).check(4, TINY)
    assert e.value.axis == "dp"
    odd_vocab = ModelConfig(num_layers=4, num_attention_heads=8, num_query_groups=4, vocab_size=130)
    with pytest.raises(InvalidLayoutError, match="vocab_size=130") as e:
        ParallelLayout.create(4, odd_vocab, tp=4)
    assert e.value.axis == "tp"
    with pytest.raises(InvalidLayoutError, match="not a positive integer"):
        ParallelLayout(tp=0)
    with pytest.raises(InvalidLayoutError, match="has no experts") as e:
        ParallelLayout(ep=2, dp=2).check(2, TINY)
    assert e.value.axis == "ep"


def test_parse_and_str():
    lay = ParallelLayout.parse("tp2-pp2", world_size=8, model=TINY)
    assert lay == ParallelLayout(tp=2, pp=2, dp=2)
    assert str(lay) == "TP2xPP2xDP2"
    assert ParallelLayout.parse(str(lay)) == lay
    assert ParallelLayout.parse("tp=2,cp=2", world_size=4) == ParallelLayout(tp=2, cp=2)
    with pytest.raises(InvalidLayoutError, match="cannot parse"):
        ParallelLayout.parse("zz2")


@given(st.sampled_from([1, 2, 4, 8, 16]).flatmap(
    lambda w: st.sampled_from(enumerate_layouts(w))))
def test_coords_roundtrip_and_groups_partition(layout):
    world = layout.world_size
    for r in range(world):
        assert layout.rank(layout.coords(r)) == r
    for axis in ("tp", "cp", "pp", "dp", "dp-cp", "tp-pp"):
        groups = layout.group_ranks(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world))
        size = 1
        for a in axis.split("-"):
            size *= getattr(layout, a)
        assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_groups_match_megatron_rank_generator(world):
    from megatron.core.parallel_state import RankGenerator
    for lay in enumerate_layouts(world):
        gen = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp,
                            order="tp-cp-ep-dp-pp")
        for axis in ("tp", "cp", "pp", "dp", "dp-cp", "tp-pp", "tp-cp"):
            assert sorted(map(sorted, gen.get_ranks(axis))) == lay.group_ranks(axis), (lay, axis)


def test_enumerate_respects_model():
    layouts = enumerate_layouts(8, TINY)
    assert ParallelLayout(tp=2, pp=2, dp=2) in layouts
    assert all(l.tp <= 4 and l.pp <= 4 for l in layouts)
    assert all(l.world_size == 8 for l in layouts)
    assert layouts == sorted(set(layouts))


MOE = ModelConfig.tiny("qwen3_moe")   # 4 experts of width 32


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_expert_groups_match_megatron_rank_generator(world):
    """The expert grid (etp x ep x edp per pp_stage) lists the ranks Megatron-Core's expert
    RankGenerator makes, for every MoE layout and both expert-TP choices."""
    from megatron.core.parallel_state import RankGenerator
    layouts = enumerate_layouts(world, MOE, expert_tp="both")
    assert any(lay.ep > 1 for lay in layouts) or world == 1
    for lay in layouts:
        dense = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp,
                              order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=lay.expert_tp, ep=lay.ep, dp=lay.edp, pp=lay.pp, cp=1,
                               order="tp-cp-ep-dp-pp", rank_offset=0)
        for axis in ("tp", "dp-cp", "tp-cp"):
            assert sorted(map(sorted, dense.get_ranks(axis))) == lay.group_ranks(axis)
        for ours, theirs in (("etp", "tp"), ("ep", "ep"), ("edp", "dp"), ("etp-ep", "tp-ep")):
            assert sorted(map(sorted, expert.get_ranks(theirs))) == \
                lay.expert_group_ranks(ours), (lay, ours)
        for r in range(world):
            c = lay.expert_coords(r)
            assert lay.coords(r).pp == c.pp
            assert lay.experts_of(c.ep, MOE.num_experts) == range(
                c.ep * 4 // lay.ep, (c.ep + 1) * 4 // lay.ep)


def test_expert_layouts_parse_print_and_refuse():
    lay = ParallelLayout.parse("EP4xTP2", 8, MOE)
    assert (lay.tp, lay.dp, lay.ep, lay.expert_tp, lay.edp) == (2, 4, 4, 2, 1)
    assert str(lay) == "EP4xTP2xDP4"
    assert ParallelLayout.parse(str(lay), 8, MOE) == lay
    one = ParallelLayout.parse("ep2,etp1,tp2", 4, MOE)
    assert str(one) == "EP2xTP2xDP2xETP1" and one.edp == 2
    assert ParallelLayout.parse(str(one), 4, MOE) == one
    assert ParallelLayout(tp=2, etp=2) == ParallelLayout(tp=2)   # etp = tp is the default
    with pytest.raises(InvalidLayoutError, match="does not divide num_experts=4") as e:
        ParallelLayout.parse("ep8", 8, MOE)
    assert e.value.axis == "ep" and "use ep in [1, 2, 4]" in str(e.value)
    with pytest.raises(InvalidLayoutError, match="does not divide tp\\*cp\\*dp") as e:
        ParallelLayout.parse("ep4xpp2", 4, MOE)      # a pp_stage has 2 ranks, not 4
    assert e.value.axis == "ep"
    with pytest.raises(InvalidLayoutError, match="moe_ffn_hidden_size=36") as e:
        ParallelLayout.parse("tp8", 8, ModelConfig.tiny("qwen3_moe", moe_ffn_hidden_size=36,
                                                        num_attention_heads=8,
                                                        num_query_groups=8, vocab_size=128))
    assert e.value.axis == "etp"
    assert all(l.ep == 1 for l in enumerate_layouts(8, TINY))
    assert {str(l) for l in enumerate_layouts(4, MOE)} >= {"EP2xDP4", "EP4xDP4", "EP2xTP2xDP2"}
