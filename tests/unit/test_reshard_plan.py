"""The reshard plan (pure): coverage, minimality, determinism, and bit-exact simulated execution.

The simulation shards reference weights with models/sharding.py under the source layout, applies
the plan's moves and local copies with plain tensor slicing, and compares every destination
rank's tensors with sharding.py's shards under the destination layout.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.models import sharding
from earl_megatron.plan.reshard_plan import placement, plan_reshard, receive_bytes
from earl_megatron.plan.tensor_table import num_parameters, tensor_table

CFGS = {
    "llama": ModelConfig.tiny("llama", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                              num_attention_heads=8, num_query_groups=8, vocab_size=64),
    "qwen2_tied": ModelConfig.tiny("qwen2", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                                   num_attention_heads=8, num_query_groups=8, vocab_size=64,
                                   tie_word_embeddings=True),
    # q/k norms (replicated over tp), head_dim 6 != 32 / 8 heads
    "qwen3": ModelConfig.tiny("qwen3", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                              num_attention_heads=8, num_query_groups=8, vocab_size=64,
                              kv_channels=6),
    # experts: 4 per layer, split over ep and etp (both etp = tp and etp = 1 enumerated)
    "qwen3_moe": ModelConfig.tiny("qwen3_moe", num_layers=4, hidden_size=32, ffn_hidden_size=64,
                                  num_attention_heads=8, num_query_groups=8, vocab_size=64,
                                  kv_channels=6, moe_ffn_hidden_size=16),
}
LAYOUTS = {w: {k: enumerate_layouts(w, c, expert_tp="both") for k, c in CFGS.items()}
           for w in (4, 8)}


@st.composite
def layout_pairs(draw):
    world = draw(st.sampled_from([4, 8]))
    kind = draw(st.sampled_from(sorted(CFGS)))
    lays = LAYOUTS[world][kind]
    return kind, draw(st.sampled_from(lays)), draw(st.sampled_from(lays))


def _intervals(holdings, rank):
    return [(p.start, p.stop) for h in holdings if h.rank == rank for p in h.pieces]


def _overlap(a, b, intervals):
    return sum(max(0, min(b, y) - max(a, x)) for x, y in intervals)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_every_destination_slice_covered_exactly_once_and_nothing_redundant(pair):
    kind, a, b = pair
    cfg = CFGS[kind]
    plan = plan_reshard(cfg, a, b)
    before, after = placement(cfg, a), placement(cfg, b)
    unit = dict(plan.unit_elements)
    covered = {}
    for t in plan.transfers + plan.local_copies:
        covered.setdefault((t.name, t.dst, t.dst_local), []).append((t.start, t.stop))
    needed = {(name, h.rank, h.local_name): sorted((p.start, p.stop) for p in h.pieces)
              for name, hs in after.items() for h in hs}
    assert covered.keys() == needed.keys()
    for key, got in covered.items():
        got = sorted(got)
        # pieces tile the needed rows: no overlap (each row once), no gap
        assert all(x[1] <= y[0] for x, y in zip(got, got[1:])), (key, got)
        assert sum(y - x for x, y in got) == sum(y - x for x, y in needed[key]), key
        assert all(any(p <= x and y <= q for p, q in needed[key]) for x, y in got), key
    min_elems = sum(
        unit[name] * (p.length - _overlap(p.start, p.stop, _intervals(before[name], h.rank)))
        for name, hs in after.items() for h in hs for p in h.pieces)
    for t in plan.transfers:
        assert t.src != t.dst
        # never sent to a rank that already held those rows; the sender holds all of them
        assert _overlap(t.start, t.stop, _intervals(before[t.name], t.dst)) == 0, t
        assert _overlap(t.start, t.stop, _intervals(before[t.name], t.src)) == t.rows, t
    for t in plan.local_copies:
        assert t.src == t.dst
        assert _overlap(t.start, t.stop, _intervals(before[t.name], t.src)) == t.rows, t
    assert plan.min_bytes == min_elems * 4
    assert plan.bytes_moved == plan.min_bytes
    assert sum(plan.send_bytes()) == sum(plan.recv_bytes()) == plan.bytes_moved
    # what the selector prices: each rank receives exactly what it lacks
    assert plan.recv_bytes() == receive_bytes(cfg, a, b)
    if a == b:
        assert plan.bytes_moved == 0 and not plan.transfers


@settings(max_examples=25, deadline=None)
@given(layout_pairs(), st.sampled_from([256, 4096, 1 << 20]))
def test_plan_is_a_pure_function_and_rounds_respect_the_bucket(pair, bucket):
    kind, a, b = pair
    cfg = CFGS[kind]
    first = plan_reshard(cfg, a, b)
    plan_reshard(cfg, b, a)                        # other plans in between change nothing
    plan_reshard(cfg, LAYOUTS[a.world_size][kind][0], a)
    assert plan_reshard(cfg, a, b) == first
    rounds = first.rounds(bucket, kinds=3)
    assert rounds == first.rounds(bucket, kinds=3)
    flat = sorted(t for r in rounds for t in r)
    # chunks re-join into the plan's transfers
    assert sum(t.elements for t in flat) == sum(t.elements for t in first.transfers)
    unit = dict(first.unit_elements)
    for rnd in rounds:
        sent, got = {}, {}
        for t in rnd:
            sent[t.src] = sent.get(t.src, 0) + t.elements * 12
            got[t.dst] = got.get(t.dst, 0) + t.elements * 12
        for side, per_rank in (("src", sent), ("dst", got)):
            for r, n in per_rank.items():
                mine = [t for t in rnd if getattr(t, side) == r]
                # over the bucket only as a lone single-row chunk that no bucket can hold
                assert n <= bucket or (len(mine) == 1 and mine[0].rows == 1), (r, n, bucket)
        for t in rnd:
            assert t.rows == 1 or t.elements * 12 <= bucket
            assert t.elements == unit[t.name] * t.rows


def _simulate(cfg, a, b):
    full = sharding.reference_weights(cfg, seed=5)
    before, after = placement(cfg, a), placement(cfg, b)

    def shards(pl, layout):
        out = {}
        for name, hs in pl.items():
            for h in hs:
                row = tensor_table(cfg).row(name)
                out[(h.rank, h.local_name)] = sharding.shard(
                    row, full[name], row.tp_rank_of(layout, h.rank), row.tp_of(layout))
        return out

    src, want = shards(before, a), shards(after, b)
    got = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    for t in plan_reshard(cfg, a, b).transfers + plan_reshard(cfg, a, b).local_copies:
        s = src[(t.src, t.src_local)].narrow(t.dim, t.src_offset, t.rows)
        got[(t.dst, t.dst_local)].narrow(t.dim, t.dst_offset, t.rows).copy_(s)
    return got, want


DENSE_PAIRS = [("tp2-pp2", "tp4"), ("pp4", "tp2-dp2"), ("tp4", "pp2-cp2"), ("dp4", "tp2-pp2"),
               ("tp2-cp2", "cp2-pp2"), ("pp2-dp2", "tp4")]
EP_PAIRS = [("dp4", "ep2"), ("ep4", "ep2xtp2"), ("ep2xtp2", "ep2,tp2,etp1"),
            ("ep2xpp2", "ep4,tp2,etp1"), ("ep2xcp2", "ep4xtp4,etp1")]


@pytest.mark.parametrize("kind,a,b", [(k, a, b) for k in sorted(CFGS) for a, b in DENSE_PAIRS]
                         + [("qwen3_moe", a, b) for a, b in EP_PAIRS])
def test_executing_the_plan_reproduces_the_destination_shards_bit_exact(kind, a, b):
    cfg = CFGS[kind]
    got, want = _simulate(cfg, ParallelLayout.parse(a, 4, cfg),
                          ParallelLayout.parse(b, 4, cfg))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_hand_computed_bytes():
    cfg = ModelConfig.tiny()  # h=64 f=128 8 heads 4 groups d=8 vocab=128 4 layers, untied
    tp2, dp2 = ParallelLayout.parse("tp2", 2, cfg), ParallelLayout.parse("dp2", 2, cfg)
    # per layer: qkv 128x64 + proj 64x64 + fc1 256x64 + fc2 64x128 = 36864 split elements;
    # 4 layers + embedding and output layer (128x64 each) = 163840; each rank lacks half.
    assert plan_reshard(cfg, tp2, dp2).bytes_moved == 163840 * 4
    assert plan_reshard(cfg, dp2, tp2).bytes_moved == 0      # dropping rows needs no transfer
    plan = plan_reshard(cfg, tp2, dp2, element_bytes=12)   # weights + 2 fp32 moments
    assert plan.bytes_moved == plan.min_bytes == 163840 * 12
    assert max(plan.send_bytes()) == max(plan.recv_bytes()) == 81920 * 12
    assert plan_reshard(cfg, tp2, tp2).bytes_moved == 0
    # PP2 -> PP1 over 2 ranks (dp fills): each rank lacks the other pp_stage's tensors
    pp2, one = ParallelLayout.parse("pp2", 2, cfg), ParallelLayout.parse("dp2", 2, cfg)
    assert plan_reshard(cfg, pp2, one).bytes_moved == num_parameters(cfg) * 4


def test_tied_embedding_replica_on_the_last_stage_is_a_source():
    cfg = CFGS["qwen2_tied"]
    a = ParallelLayout.parse("pp4", 4, cfg)
    b = ParallelLayout.parse("pp2-dp2", 4, cfg)
    plan = plan_reshard(cfg, a, b)
    emb = [t for t in plan.transfers + plan.local_copies
           if t.name == "embedding.word_embeddings.weight"]
    # rank 3 holds the replica as output_layer.weight under PP4 and keeps it under PP2xDP2
    assert any(t.src == 3 and t.dst == 3 and t.src_local == "output_layer.weight" for t in emb)
    # rank 2 (pp_stage 1 of PP2xDP2) gets the replica from 0 or 3, whichever is less loaded
    assert {t.src for t in emb if t.dst == 2} <= {0, 3}


def test_errors_name_the_problem():
    cfg = CFGS["llama"]
    with pytest.raises(ValueError, match="different world sizes"):
        plan_reshard(cfg, ParallelLayout.parse("tp2", 2), ParallelLayout.parse("tp4", 4))


def test_receive_bytes_by_hand():
    """What the selector prices a switch with (plan/selector.py: ``switch_seconds``)."""
    cfg = ModelConfig.tiny()
    dp2, tp2, pp2 = (ParallelLayout.parse(x, 2, cfg) for x in ("dp2", "tp2", "pp2"))
    assert plan_reshard(cfg, dp2, tp2).recv_bytes() == (0, 0)       # already hold everything
    half = 163840 // 2                  # the other tp half of every split tensor (above)
    assert plan_reshard(cfg, tp2, dp2).recv_bytes() == (half * 4, half * 4)
    # pp2 -> dp2: rank 0 lacks layers 2-3, the final norm and the output layer; rank 1 lacks
    # layers 0-1 and the embedding (per layer 36864 split + 128 norm elements)
    layer, vocab = 36864 + 128, 128 * 64
    assert plan_reshard(cfg, pp2, dp2).recv_bytes() == ((2 * layer + 64 + vocab) * 4,
                                                        (2 * layer + vocab) * 4)
    assert plan_reshard(cfg, pp2, pp2).recv_bytes() == (0, 0)


def test_moving_experts_between_ep_layouts_moves_whole_expert_rows():
    """By hand, 4 ranks, 4 experts. EP2: ep rank = rank % 2 (experts {0, 1} on ranks 0, 2;
    {2, 3} on ranks 1, 3); EP4: rank r holds expert r. DP4 -> EP2 only drops experts; EP2 ->
    EP4: ranks 1 and 2 lack their expert; EP4 -> EP2: ranks 0 and 3 lack one, ranks 1 and 2
    both of theirs but the one they keep. Every transfer is whole rows of an expert."""
    cfg = CFGS["qwen3_moe"]
    dp4, ep2, ep4 = (ParallelLayout.parse(x, 4, cfg) for x in ("dp4", "ep2", "ep4"))
    table = tensor_table(cfg)
    one = sum(r.numel for r in table.rows if r.expert == 0) * 4   # bytes, every layer
    assert plan_reshard(cfg, dp4, ep2).bytes_moved == 0
    assert plan_reshard(cfg, ep2, ep4).recv_bytes() == (0, one, one, 0)
    plan = plan_reshard(cfg, ep4, ep2)
    assert plan.recv_bytes() == (one, 2 * one, 2 * one, one) == receive_bytes(cfg, ep4, ep2)
    assert {t.name for t in plan.transfers} == {r.name for r in table.rows if r.expert is not None}
    # rank 0 (experts 0, 1 under EP2) gets expert 1 from rank 1, its only holder under EP4,
    # where it is local expert 0; under EP2 it is local expert 1
    e1 = [t for t in plan.transfers if t.dst == 0]
    assert {t.src for t in e1} == {1}
    assert all(".local_experts.1." in t.name and ".local_experts.0." in t.src_local
               and ".local_experts.1." in t.dst_local for t in e1)
    assert all((t.start, t.stop) == (0, table.row(t.name).shape[t.dim]) for t in e1)
    # experts are replicated over edp: EP2 on 4 ranks has 2 replicas of each
    name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    assert [h.rank for h in placement(cfg, ep2)[name]] == [1, 3]
    assert plan_reshard(cfg, ep2, dp4).replicas_of(name, 1) == (1, 3)
    # dense tensors keep their dp x cp replicas
    assert plan.replicas_of("decoder.final_layernorm.weight", 2) == (0, 1, 2, 3)
