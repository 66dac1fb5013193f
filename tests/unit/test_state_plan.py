"""The optimizer-state plan (pure), checked element by element.

Boxes: ``count_below`` and ``pieces`` against enumerating every box element. Segments: every
full tensor gets unique element ids, sharded with models/sharding.py under both layouts; each
old rank owns a flat range of each local tensor (the whole of it: plain optimizer; a random
partition over the dp x cp replicas, an expert's over its edp replicas: distributed optimizer)
and holds NaN elsewhere. Executing the segments must fill every new rank's range with the right
ids, each element written once, never reading a NaN, and send exactly the elements the
destination did not own before.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.models import sharding
from earl_megatron.plan.reshard_plan import placement, plan_reshard
from earl_megatron.plan.state_plan import Box, plan_state_segments, segment_rounds
from earl_megatron.plan.tensor_table import tensor_table

CFGS = {
    "llama": ModelConfig.tiny("llama", num_layers=4, hidden_size=16, ffn_hidden_size=32,
                              num_attention_heads=4, num_query_groups=4, vocab_size=32),
    "qwen2_tied": ModelConfig.tiny("qwen2", num_layers=4, hidden_size=16, ffn_hidden_size=32,
                                   num_attention_heads=4, num_query_groups=4, vocab_size=32,
                                   tie_word_embeddings=True),
    # q/k norms (replicated over tp), head_dim 6 != 16 / 4 heads
    "qwen3": ModelConfig.tiny("qwen3", num_layers=4, hidden_size=16, ffn_hidden_size=32,
                              num_attention_heads=4, num_query_groups=4, vocab_size=32,
                              kv_channels=6),
    # experts: 4 per layer, split over ep and etp (both etp = tp and etp = 1 enumerated)
    "qwen3_moe": ModelConfig.tiny("qwen3_moe", num_layers=4, hidden_size=16, ffn_hidden_size=32,
                                  num_attention_heads=4, num_query_groups=4, vocab_size=32,
                                  kv_channels=6, moe_ffn_hidden_size=8),
}
LAYOUTS = {w: {k: enumerate_layouts(w, c, expert_tp="both") for k, c in CFGS.items()}
           for w in (4, 8)}


@st.composite
def boxes(draw):
    two_d = draw(st.booleans())
    shape = (draw(st.integers(1, 7)), draw(st.integers(1, 7))) if two_d \
        else (draw(st.integers(1, 9)),)
    dim = draw(st.sampled_from([0, 1])) if two_d else 0
    offset = draw(st.integers(0, shape[dim] - 1))
    rows = draw(st.integers(1, shape[dim] - offset))
    return Box(shape, dim, offset, rows)


def _box_flat(box):
    """Local flat index of every box element, in box order (by enumeration)."""
    idx = torch.arange(torch.Size(box.shape).numel()).view(box.shape)
    return idx.narrow(box.dim, box.offset, box.rows).reshape(-1).tolist()


@settings(max_examples=300, deadline=None)
@given(boxes(), st.data())
def test_box_intervals_and_pieces_match_enumeration(box, data):
    flat = _box_flat(box)
    assert box.numel == len(flat)
    assert [box.flat_of(k) for k in range(len(flat))] == flat
    n = torch.Size(box.shape).numel()
    for x in range(-1, n + 2):
        assert box.count_below(x) == sum(f < x for f in flat), x
    u = data.draw(st.integers(0, len(flat)))
    v = data.draw(st.integers(u, len(flat)))
    pieces = box.pieces(u, v)
    assert len(pieces) <= 3
    got = [b.start + i * b.stride + j for b in pieces for i in range(b.rows) for j in range(b.cols)]
    assert got == flat[u:v]


def _ranges(cfg, layout, mode, seed):
    """{rank: {local: (shape, start, stop)}} and the local shapes, for a plain or distributed
    optimizer (a random partition of each local tensor over its dp x cp replicas)."""
    rnd = random.Random(seed)
    table = tensor_table(cfg)
    groups = {}
    for r in range(layout.world_size):   # replicas: dense (tp, pp); experts (etp, ep, pp)
        c, e = layout.coords(r), layout.expert_coords(r)
        groups.setdefault((c.tp, c.pp), []).append(r)
        groups.setdefault(("expert", e.etp, e.ep, e.pp), []).append(r)
    out = {r: {} for r in range(layout.world_size)}
    for name, holds in placement(cfg, layout).items():
        for h in holds:
            if h.local_name in out[h.rank]:
                continue
            c, e = layout.coords(h.rank), layout.expert_coords(h.rank)
            row = table.row(name)
            shape = tuple(sharding.shard(row, torch.empty(row.shape), row.tp_rank_of(
                layout, h.rank), row.tp_of(layout)).shape)
            n = torch.Size(shape).numel()
            reps = groups[(c.tp, c.pp) if row.expert is None else ("expert", e.etp, e.ep, e.pp)]
            if mode == "plain":
                for r in reps:
                    out[r][h.local_name] = (shape, 0, n)
            else:
                cuts = sorted([0, n] + [rnd.randint(0, n) for _ in reps[1:]])
                for r, a, b in zip(reps, cuts, cuts[1:]):
                    out[r][h.local_name] = (shape, a, b)
    return out


def _ids(cfg, layout):
    """{(rank, local): local tensor of unique element ids (float64)} under ``layout``."""
    full, base = {}, 0
    table = tensor_table(cfg)
    for row in sorted(table.full_rows, key=lambda r: r.name):
        full[row.name] = torch.arange(base, base + row.numel, dtype=torch.float64).view(row.shape)
        base += row.numel
    return {(h.rank, h.local_name): sharding.shard(
                table.row(name), full[name], table.row(name).tp_rank_of(layout, h.rank),
                table.row(name).tp_of(layout)).reshape(-1)
            for name, holds in placement(cfg, layout).items() for h in holds}


def _take(flat, blocks):
    return torch.cat([flat.as_strided((b.rows, b.cols), (b.stride, 1), b.start).reshape(-1)
                      for b in blocks])


def _put(flat, blocks, values):
    at = 0
    for b in blocks:
        view = flat.as_strided((b.rows, b.cols), (b.stride, 1), b.start)
        view.copy_(values[at:at + b.numel].view(b.rows, b.cols))
        at += b.numel


@st.composite
def cases(draw):
    world = draw(st.sampled_from([4, 8]))
    kind = draw(st.sampled_from(sorted(CFGS)))
    lays = LAYOUTS[world][kind]
    return (kind, draw(st.sampled_from(lays)), draw(st.sampled_from(lays)),
            draw(st.sampled_from(["plain", "distributed"])),
            draw(st.sampled_from(["plain", "distributed"])), draw(st.integers(0, 10**6)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_segments_fill_every_new_range_once_from_its_old_owner_moving_the_minimum(case):
    kind, a, b, old_mode, new_mode, seed = case
    cfg = CFGS[kind]
    plan = plan_reshard(cfg, a, b)
    old, new = _ranges(cfg, a, old_mode, seed), _ranges(cfg, b, new_mode, seed + 1)
    src_ids, want_ids = _ids(cfg, a), _ids(cfg, b)
    owned = {}
    for (r, local), ids in src_ids.items():   # NaN where the old rank owns no state
        _, s, e = old[r][local]
        t = torch.full_like(ids, float("nan"))
        t[s:e] = ids[s:e]
        owned[(r, local)] = t
    got = {k: torch.full_like(v, float("nan")) for k, v in want_ids.items()}
    writes = {k: torch.zeros_like(v) for k, v in want_ids.items()}
    moved = 0
    for seg in plan_state_segments(plan, old, new):
        values = _take(owned[(seg.src, seg.src_local)], seg.src_box.pieces(seg.u, seg.v))
        assert not values.isnan().any(), seg   # read only what the source owned
        blocks = seg.dst_box.pieces(seg.u, seg.v)
        _put(got[(seg.dst, seg.dst_local)], blocks, values)
        _put(writes[(seg.dst, seg.dst_local)], blocks,
             _take(writes[(seg.dst, seg.dst_local)], blocks) + 1)
        moved += seg.elements if seg.src != seg.dst else 0
    minimum = 0
    for r in range(b.world_size):
        had = {x for (q, _), t in owned.items() if q == r for x in t[~t.isnan()].tolist()}
        for local, (_, s, e) in new[r].items():
            want, key = want_ids[(r, local)], (r, local)
            assert torch.equal(got[key][s:e], want[s:e]), (r, local)
            assert (writes[key][s:e] == 1).all() and writes[key][:s].sum() == 0 \
                and writes[key][e:].sum() == 0, (r, local)
            minimum += sum(x not in had for x in want[s:e].tolist())
    assert moved == minimum


@pytest.mark.parametrize("bucket", [64, 1000, 1 << 20])
def test_segment_rounds_respect_the_bucket_and_keep_every_element(bucket):
    cfg = CFGS["llama"]
    a, b = (ParallelLayout.parse(s, 4, cfg) for s in ("tp2-dp2", "pp2-dp2"))
    plan = plan_reshard(cfg, a, b)
    segs = plan_state_segments(plan, _ranges(cfg, a, "distributed", 1),
                               _ranges(cfg, b, "distributed", 2))
    rounds = segment_rounds(segs, 12, bucket)
    assert sum(s.elements for r in rounds for s in r) == sum(
        s.elements for s in segs if s.src != s.dst)
    for rnd in rounds:
        for r in range(4):
            for side in ("src", "dst"):
                mine = [s for s in rnd if getattr(s, side) == r]
                assert sum(s.elements * 12 for s in mine) <= bucket or len(mine) == 1


def test_uncovered_state_is_an_error():
    cfg = CFGS["llama"]
    a, b = (ParallelLayout.parse(s, 4, cfg) for s in ("dp4", "tp4"))
    old = _ranges(cfg, a, "distributed", 3)
    old[0] = {k: (shape, 0, 0) for k, (shape, _, _) in old[0].items()}   # rank 0 lost its state
    with pytest.raises(ValueError, match="owned by no old rank"):
        plan_state_segments(plan_reshard(cfg, a, b), old, _ranges(cfg, b, "plain", 4))
