"""The weight plan executed (runtime/weight_transfer.py) on 4 gloo ranks, one launch: bit-exact
against ``gather_full`` (the all-gather every rank used to receive), with each rank's bytes.

- ``full_weights_at``: from TP2xDP2, PP2xDP2, TP2xCP2, TP4, PP2xTP2 with tied embeddings, EP2xTP2
  (Qwen3-MoE, experts split by etp), and TP2xDP2 in bf16, to two pushing ranks (0 and 2: two
  servers) and to one (rank 0), in buckets of 40 KB: every pusher assembles every full tensor,
  equal to ``gather_full``'s, each in its model's dtype (a bf16 model's norms stay
  fp32); the bytes each rank received over the wire are
  the plan's ``recv_bytes()`` exactly, 0 at every rank that does not push; no bucket lands more
  than the bound at a pusher unless it is one tensor;
- ``load_shards``: a model in another layout on the same ranks (TP2xDP2 -> PP2xDP2,
  PP2xTP2 -> TP4 tied, EP2 -> EP2xTP2) receives the source's weights: its ``gather_full`` equals
  the source's, bit-exact.
"""

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

BUCKET = 40_000
PUSHES = [("llama", "tp2xdp2"), ("llama", "pp2xdp2"), ("llama", "tp2xcp2"), ("llama", "tp4"),
          ("tied", "pp2xtp2"), ("moe", "ep2xtp2"), ("bf16", "tp2xdp2")]
HANDOFFS = [("llama", "tp2xdp2", "pp2xdp2"), ("tied", "pp2xtp2", "tp4"),
            ("moe", "ep2", "ep2xtp2")]
PUSHERS = [(0, 2), (0,)]


def _cfg(kind):
    from earl_megatron.config.model import ModelConfig

    return {"llama": ModelConfig.tiny(tie_word_embeddings=False),
            "tied": ModelConfig.tiny("qwen2", tie_word_embeddings=True),
            "moe": ModelConfig.tiny("qwen3_moe"),
            "bf16": ModelConfig.tiny(tie_word_embeddings=False, params_dtype="bfloat16")}[kind]


def _four_ranks():
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.transport import Traffic
    from earl_megatron.runtime.weight_transfer import cached_plan, full_weights_at, load_shards
    from earl_megatron.plan.weight_plan import FullAt
    from earl_megatron.weights.gather import gather_full

    me, world = dist.get_rank(), dist.get_world_size()
    out = {"push": [], "handoff": []}
    with cpu_backend():
        for kind, name in PUSHES:
            cfg = _cfg(kind)
            lay = ParallelLayout.parse(name, world_size=world, model=cfg)
            mol = build_on_layout(cfg, lay, ddp=False, seed=5)
            ref = gather_full(mol.model, cfg, lay)
            for pushers in PUSHERS:
                traffic, got, buckets = Traffic(), {}, []
                for _, n, bucket in full_weights_at(mol, pushers, BUCKET, traffic):
                    if bucket is not None:
                        buckets.append(sum(t.numel() * t.element_size()
                                           for t in bucket.values()))
                        got.update(bucket)
                plan = cached_plan(cfg, lay, tuple(FullAt(r) for r in pushers), BUCKET, world)
                same = set(got) == set(ref) and all(torch.equal(got[k].float(), ref[k])
                                                    for k in ref)
                dtypes = sorted({str(t.dtype) for t in got.values()})
                out["push"].append(((kind, name, pushers), me in pushers, same, n,
                                    traffic.bytes_received, plan.recv_bytes()[me], buckets,
                                    [len(b.names) for b in plan.buckets], dtypes))
            groups.destroy_groups()
        for kind, a, b in HANDOFFS:
            cfg = _cfg(kind)
            src_lay = ParallelLayout.parse(a, world_size=world, model=cfg)
            dst_lay = ParallelLayout.parse(b, world_size=world, model=cfg)
            src = build_on_layout(cfg, src_lay, ddp=False, seed=6)
            ref = gather_full(src.model, cfg, src_lay)
            dst = build_on_layout(cfg, dst_lay, ddp=False, seed=7)
            before = gather_full(dst.model, cfg, dst_lay)
            traffic = Traffic()
            load_shards(src, dst, BUCKET, traffic)
            after = gather_full(dst.model, cfg, dst_lay)
            out["handoff"].append(((kind, a, b), all(torch.equal(after[k], ref[k]) for k in ref),
                                   any(not torch.equal(before[k], ref[k]) for k in ref),
                                   traffic.bytes_received))
            groups.destroy_groups()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_four_ranks, 4, timeout=400)


def test_pushers_assemble_the_full_weights_bit_exact_and_nobody_else_receives(results):
    for rank, res in enumerate(results):
        for case, pushes, same, n, got, planned, buckets, rows, dtypes in res["push"]:
            assert got == planned, (rank, case, got, planned)   # the plan's bytes, exactly
            if not pushes:
                assert got == 0 and not buckets, (rank, case)
                continue
            assert same, (rank, case)
            # each tensor in its own dtype: a bf16 model keeps its norms in fp32
            assert dtypes == (["torch.bfloat16", "torch.float32"] if case[0] == "bf16"
                              else ["torch.float32"]), (case, dtypes)
            assert got > 0 and len(buckets) == n > 3, (rank, case, n)
            # a pusher assembles at most one bucket: the bound, or one tensor alone
            assert all(b <= BUCKET or k == 1 for b, k in zip(buckets, rows)), (case, buckets)


def test_a_model_in_another_layout_receives_its_shards_bit_exact(results):
    for rank, res in enumerate(results):
        for case, same, changed, got in res["handoff"]:
            assert same and changed, (rank, case)
    # something crossed ranks in every handoff (each layout pair regroups the shards)
    for k, case in enumerate(HANDOFFS):
        assert sum(res["handoff"][k][3] for res in results) > 0, case


def test_a_bucket_moves_one_message_per_peer_and_dtype():
    """``_per_peer`` without a world: a bucket's transfers between two ranks of one dtype are
    one message, in the plan's order (both sides read the same plan), of their summed bytes."""
    from types import SimpleNamespace

    import torch

    from earl_megatron.runtime.weight_transfer import _per_peer

    def t(name, src, dst, elements):
        return SimpleNamespace(name=name, src=src, dst=dst, elements=elements)

    plan = [t("a", 0, 2, 10), t("norm", 0, 2, 4), t("b", 1, 2, 6), t("c", 0, 2, 3),
            t("d", 0, 3, 5)]
    dtypes = {"a": torch.bfloat16, "b": torch.bfloat16, "c": torch.bfloat16,
              "d": torch.bfloat16, "norm": torch.float32}
    got = {(m.src, m.dst, m.nbytes): [x.name for x in m.key] for m in _per_peer(plan, dtypes)}
    assert got == {(0, 2, 26): ["a", "c"], (0, 2, 16): ["norm"], (1, 2, 12): ["b"],
                   (0, 3, 10): ["d"]}
