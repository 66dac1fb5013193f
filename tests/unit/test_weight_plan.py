"""The weight-transfer plan (pure): exact bytes per rank, bit-exact simulated execution, buckets.

The simulation shards reference weights with models/sharding.py under the source layout, applies
the plan's transfers and local copies with plain tensor slicing, and compares what every
destination assembled with the reference (``FullAt``) or with sharding.py's shards under the
destination layout (``ShardsIn``).
"""

import pytest
import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.models import sharding
from earl_megatron.plan.layout import ParallelLayout, enumerate_layouts
from earl_megatron.plan.weight_plan import (FullAt, ShardsIn, minimum_recv_bytes, plan_weights,
                                            transfer_seconds)
from earl_megatron.plan.reshard_plan import plan_reshard
from earl_megatron.plan.tensor_table import num_parameters, tensor_table

SMALL = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=8,
             num_query_groups=8, vocab_size=64)
CFGS = {
    "llama": ModelConfig.tiny("llama", **SMALL),
    "qwen2_tied": ModelConfig.tiny("qwen2", tie_word_embeddings=True, **SMALL),
    "qwen3": ModelConfig.tiny("qwen3", kv_channels=6, **SMALL),
    "qwen3_moe": ModelConfig.tiny("qwen3_moe", kv_channels=6, moe_ffn_hidden_size=16, **SMALL),
}


def _leaders(world: int) -> list[tuple[int, ...]]:
    """Pushing ranks of rollout layouts tp x dp on ``world`` ranks: the first rank of each
    replica (tp1 servers: every rank; one server: rank 0)."""
    return [tuple(range(0, world, tp)) for tp in (1, 2, world)]


GRID = [(kind, lay, leaders) for kind, cfg in sorted(CFGS.items())
        for world in (4, 8) for lay in enumerate_layouts(world, cfg, expert_tp="both")
        for leaders in _leaders(world)]


@pytest.mark.parametrize("kind,src,leaders", GRID, ids=lambda x: str(x))
def test_pushers_receive_exactly_what_they_lack_and_nobody_else_anything(kind, src, leaders):
    cfg = CFGS[kind]
    plan = plan_weights(cfg, src, [FullAt(r) for r in leaders], bucket_bytes=20_000)
    recv = plan.recv_bytes()
    for r in range(src.world_size):
        want = minimum_recv_bytes(cfg, src, r) if r in leaders else 0
        assert recv[r] == want, (r, recv[r], want)
    assert sum(plan.send_bytes()) == sum(recv)
    # each pusher at most the model's bytes (exactly them less its own shard)
    assert all(recv[r] < plan.model_bytes for r in leaders)
    _check_buckets(plan)


def _check_buckets(plan):
    names = [n for b in plan.buckets for n in b.names]
    assert names == [n for n, _ in plan.row_shapes]        # every tensor once, model order
    for b, (sent, landed) in zip(plan.buckets, plan.bucket_loads()):
        if len(b.names) > 1:
            assert max(list(sent.values()) + list(landed.values())) <= plan.bucket_bytes
        assert all(t.name in b.names for t in b.transfers + b.local_copies)


def test_hand_computed_bytes():
    # h=64 f=128 8 heads 4 groups d=8 vocab=128 4 layers, untied: split elements per layer
    # qkv 128x64 + proj 64x64 + fc1 256x64 + fc2 64x128 = 36864; + embedding and output layer
    # (128x64 each) = 163840 split elements, 9 norms of 64 replicated
    cfg = ModelConfig.tiny()
    model = num_parameters(cfg) * 4
    assert model == (163840 + 9 * 64) * 4
    tp2xdp2 = ParallelLayout.parse("tp2xdp2", 4, cfg)
    # two servers (leaders 0 and 2): each holds the tp0 half and receives the tp1 half, from
    # rank 1 and rank 3 respectively (the least-loaded replica); ranks 1 and 3 receive nothing
    plan = plan_weights(cfg, tp2xdp2, [FullAt(0), FullAt(2)], bucket_bytes=1 << 20)
    assert plan.recv_bytes() == (81920 * 4, 0, 81920 * 4, 0)
    assert plan.send_bytes() == (0, 81920 * 4, 0, 81920 * 4)
    # PP2xDP2: leader 0 (pp_stage 0) lacks layers 2-3 (2 x (36864 + 128)), the final norm and
    # the output layer; those come from ranks 2 and 3 (pp_stage 1), split between them
    pp2xdp2 = ParallelLayout.parse("pp2xdp2", 4, cfg)
    plan = plan_weights(cfg, pp2xdp2, [FullAt(0)], bucket_bytes=1 << 20)
    lack = (2 * (36864 + 128) + 64 + 128 * 64) * 4
    assert plan.recv_bytes() == (lack, 0, 0, 0)
    assert plan.send_bytes()[1] == 0 and plan.send_bytes()[2] > 0 and plan.send_bytes()[3] > 0
    # a rank outside the source layout (a rollout pool's leader) receives the whole model
    plan = plan_weights(cfg, tp2xdp2, [FullAt(4)], bucket_bytes=1 << 20)
    assert plan.recv_bytes() == (0, 0, 0, 0, model) and plan.world_size == 5


def test_tied_embedding_is_pushed_once_from_either_replica():
    cfg = CFGS["qwen2_tied"]
    src = ParallelLayout.parse("pp2xtp2", 4, cfg)
    plan = plan_weights(cfg, src, [FullAt(3)], bucket_bytes=1 << 20)
    emb = [t for b in plan.buckets for t in b.transfers + b.local_copies
           if t.name == "embedding.word_embeddings.weight"]
    # rank 3 (pp_stage 1, tp1) holds half the embedding as output_layer.weight: a local copy
    assert any(t.src == 3 and t.src_local == "output_layer.weight" for t in emb)
    assert sum(t.rows for t in emb) == cfg.vocab_size            # every row exactly once
    assert "output_layer.weight" not in [n for b in plan.buckets for n in b.names]


def _simulate(cfg, src, plan):
    """Execute ``plan`` on tensors (module docstring): {(rank, name): tensor} assembled."""
    table = tensor_table(cfg)
    ref = sharding.reference_weights(cfg, seed=1)
    have = {}
    for r in range(src.world_size):
        for row in table.held_on(src, r):
            full = table.row(row.tied_to) if row.tied_to else row
            have[(r, table.name_on(row, src))] = sharding.shard(
                full, ref[full.name], row.tp_rank_of(src, r), row.tp_of(src))
    got = {}
    for b in plan.buckets:
        for t in b.transfers + b.local_copies:
            shape = dict(plan.row_shapes)[t.name] if t.dst in plan.full_ranks else None
            key = (t.dst, t.dst_local)
            if key not in got:
                got[key] = torch.full(shape, float("nan")) if shape else None
            piece = have[(t.src, t.src_local)].narrow(t.dim, t.src_offset, t.rows)
            if shape is None:
                got.setdefault(("pieces",) + key, []).append((t.dst_offset, t.dim, piece))
            else:
                got[key].narrow(t.dim, t.dst_offset, t.rows).copy_(piece)
    return ref, have, got


@pytest.mark.parametrize("kind,name", [("llama", "tp2xdp2"), ("llama", "pp2xdp2"),
                                       ("llama", "tp2xcp2"), ("qwen2_tied", "pp2xtp2"),
                                       ("qwen3_moe", "ep2xtp2"), ("qwen3_moe", "ep4,tp2,etp1")])
def test_executing_the_push_plan_assembles_the_full_weights_bit_exact(kind, name):
    cfg = CFGS[kind]
    src = ParallelLayout.parse(name, 4, cfg)
    plan = plan_weights(cfg, src, [FullAt(0), FullAt(2)], bucket_bytes=4_000)
    ref, _, got = _simulate(cfg, src, plan)
    for r in (0, 2):
        assert {n for (d, n) in got if d == r} == set(ref)
        for n, t in ref.items():
            assert torch.equal(got[(r, n)], t), (r, n)


@pytest.mark.parametrize("kind,a,b,offset", [("llama", "tp2xdp2", "pp2xdp2", 0),
                                              ("llama", "pp2xtp2", "tp4", 4),
                                              ("qwen2_tied", "pp4", "pp2xdp2", 0),
                                              ("qwen3_moe", "ep2xtp2", "ep4,tp2,etp1", 4)])
def test_a_pool_in_another_layout_gets_its_shards(kind, a, b, offset):
    """ShardsIn on the same ranks equals the switch's plan; on ranks 4..7 (a rollout pool
    beside the trainers) every pool rank receives its whole shard."""
    cfg = CFGS[kind]
    src, dst = ParallelLayout.parse(a, 4, cfg), ParallelLayout.parse(b, 4, cfg)
    ranks = tuple(range(offset, offset + 4))
    plan = plan_weights(cfg, src, [ShardsIn(dst, ranks)], bucket_bytes=4_000)
    table = tensor_table(cfg)
    ref, _, got = _simulate(cfg, src, plan)
    for i, r in enumerate(ranks):
        for row in table.held_on(dst, i):
            full = table.row(row.tied_to) if row.tied_to else row
            want = sharding.shard(full, ref[full.name], row.tp_rank_of(dst, i), row.tp_of(dst))
            pieces = got[("pieces", r, table.name_on(row, dst))]
            out = torch.full_like(want, float("nan"))
            for off, dim, piece in pieces:
                out.narrow(dim, off, piece.shape[dim]).copy_(piece)
            assert torch.equal(out, want), (r, row.name)
    if offset == 0:
        assert plan.recv_bytes() == plan_reshard(cfg, src, dst).recv_bytes()
    else:
        eb = 4
        assert plan.recv_bytes()[offset:] == tuple(
            eb * table.elements_on(dst.coords(i).pp, dst.tp, dst.pp, dst.ep, dst.expert_tp)
            for i in range(4))
        assert plan.recv_bytes()[:offset] == (0,) * offset
    _check_buckets(plan)


def test_one_pusher_buckets_are_the_model_cut_greedily():
    cfg = CFGS["llama"]
    src = ParallelLayout.parse("tp2xdp2", 4, cfg)
    cap = 10_000
    plan = plan_weights(cfg, src, [FullAt(1)], bucket_bytes=cap)
    want, cur, size = [], [], 0
    for row in tensor_table(cfg).full_rows:
        if cur and size + row.numel * 4 > cap:
            want.append(tuple(cur))
            cur, size = [], 0
        cur.append(row.name)
        size += row.numel * 4
    want.append(tuple(cur))
    assert [b.names for b in plan.buckets] == want


def test_errors_name_the_problem():
    cfg = CFGS["llama"]
    src = ParallelLayout.parse("tp2xdp2", 4, cfg)
    with pytest.raises(ValueError, match="at least one destination"):
        plan_weights(cfg, src, [], bucket_bytes=10)
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan_weights(cfg, src, [FullAt(0)], bucket_bytes=0)
    with pytest.raises(ValueError, match="name a rank twice"):
        plan_weights(cfg, src, [FullAt(0), ShardsIn(src)], bucket_bytes=10)
    with pytest.raises(ValueError, match="outside the world of 4 ranks"):
        plan_weights(cfg, src, [FullAt(4)], bucket_bytes=10, world_size=4)
    with pytest.raises(ValueError, match="names 2 ranks for a layout of 4"):
        plan_weights(cfg, src, [ShardsIn(src, (4, 5))], bucket_bytes=10)


def test_rows_come_from_the_pushers_node_and_the_link_model_prices_that():
    """TP8xDP2 on 2 nodes of 8: each node holds a whole replica, so each tp8 server's leader
    (ranks 0 and 8) gets every row it lacks from its own node; without node awareness the
    least-loaded replica is often across the network. Bytes per rank are the same."""
    from earl_megatron.plan.specs import ClusterSpec

    cfg = CFGS["llama"]
    src = ParallelLayout.parse("tp8xdp2", 16, cfg)
    cluster = ClusterSpec.h100_80gb(nodes=2)
    near = plan_weights(cfg, src, [FullAt(0), FullAt(8)], bucket_bytes=1 << 20,
                        devices_per_node=8)
    anywhere = plan_weights(cfg, src, [FullAt(0), FullAt(8)], bucket_bytes=1 << 20)
    moves = [t for b in near.buckets for t in b.transfers]
    assert moves and all(t.src // 8 == t.dst // 8 for t in moves)
    assert any(t.src // 8 != t.dst // 8 for b in anywhere.buckets for t in b.transfers)
    assert near.recv_bytes() == anywhere.recv_bytes()
    # the link model: intra-node only, each leader receives 7/8 of the split rows
    lack = near.recv_bytes()[0]
    want = lack / cluster.intra_node_bandwidth + len(near.buckets) * cluster.intra_node_latency_s
    assert transfer_seconds(near, cluster) == pytest.approx(want)
    assert transfer_seconds(anywhere, cluster) > transfer_seconds(near, cluster)


def test_adapters_only_moves_the_lora_rows_alone():
    """Split placement's later handoffs (trainer/handoff.py): the rollout pool holds the frozen
    base, so the plan moves each adapter's A and B, split as on the destination, and nothing
    else; a model without adapters is refused with the fix."""
    from earl_megatron.config.lora import LoraSpec

    cfg = ModelConfig.tiny("llama", lora=LoraSpec(rank=4), **SMALL)
    table = tensor_table(cfg)
    adapters = {r.name: r.numel for r in table.full_rows if r.adapter}
    assert adapters and len(adapters) < len(table.full_rows)
    train = ParallelLayout.parse("tp2", world_size=2, model=cfg)
    rollout = ParallelLayout.parse("dp2", world_size=2, model=cfg)
    plan = plan_weights(cfg, train, (ShardsIn(rollout, (2, 3)),), bucket_bytes=1 << 20,
                        adapters_only=True)
    assert {n for b in plan.buckets for n in b.names} == set(adapters)
    assert plan.model_bytes == 4 * sum(adapters.values())
    # each rollout replica (rank 2, rank 3) lands every adapter whole, from the tp2 shards
    assert plan.recv_bytes() == (0, 0, plan.model_bytes, plan.model_bytes)
    full = plan_weights(cfg, train, (ShardsIn(rollout, (2, 3)),), bucket_bytes=1 << 20)
    assert full.recv_bytes()[2] == full.model_bytes == 4 * num_parameters(cfg)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        plan_weights(ModelConfig.tiny("llama", **SMALL), train, (ShardsIn(rollout, (2, 3)),),
                     bucket_bytes=1 << 20, adapters_only=True)
