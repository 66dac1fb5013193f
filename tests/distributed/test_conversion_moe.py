"""HF Qwen3MoeForCausalLM <-> Megatron-Core: logits on expert layouts, bit-exact round trips.

Two tiny random Qwen3-MoE models are built with transformers from a ``Qwen3MoeConfig`` (4 layers,
4 experts of width 32, top 2; one with ``norm_topk_prob`` true, saved in several shards with an
index, one with it false, one file) and saved with ``save_pretrained``, which writes the hub's
per-expert tensors (``mlp.experts.<e>.{gate,up,down}_proj.weight``).

- world 1: both converted HF -> Megatron-Core (parts small enough that a part ends inside a
  layer's experts) and back; TP1 logits from the converted checkpoint and from the HF directory;
- world 4, one launch: DP4 (EP1), EP2, EP2xTP2 (sequence parallel) and EP2xPP2, each loading the
  converted checkpoint (dist_checkpointing resharding the expert keys) and the HF directory
  (each rank reads its experts' shards); logits within 1e-4 of transformers (fp32). On EP2 and
  EP2xPP2 ``gather_full`` and the weight sync's buckets (runtime/weight_transfer.py, at two
  pushing ranks) give back every HF tensor
  bit-exact (the round trip from an EP layout). A trainer checkpoint (model and distributed optimizer) saved on EP2 after two steps
  loads on DP4 (EP1) with every weight equal and the next steps' losses equal; the plain
  optimizer's state, whose chaining differs between ep = 1 and ep > 1, is refused in one line;
- world 1: that trainer checkpoint exported to HF equals the EP2 model's weights bit-exact, and
  transformers loads the export with no tensor missing or left over.
"""

import json

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
BATCH, SEQ = 2, 16
MODELS = ("norm_topk", "plain_topk")           # norm_topk_prob true / false
LAYOUTS = ["dp4", "ep2", "ep2xtp2", "ep2xpp2"]
ROUND_TRIP = ("ep2", "ep2xpp2")


def _hf_model(name: str):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=name == "norm_topk", max_position_embeddings=256,
                         rms_norm_eps=1e-6, router_aux_loss_coef=0.01,
                         rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
    torch.manual_seed(MODELS.index(name) + 11)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them matter; sharper routing
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def _tokens():
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _hf_tensors(path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (hf_dir, mcore_dir, roundtrip_dir, reference logits)} and the world-1 results."""
    root = tmp_path_factory.mktemp("conversion_moe")
    out = {}
    for name in MODELS:
        model = _hf_model(name)
        hf_dir = root / name / "hf"
        model.save_pretrained(hf_dir, max_shard_size="200KB" if name == "norm_topk" else "50MB")
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
        with torch.no_grad():
            logits = model(_tokens()).logits.float()
        out[name] = (hf_dir, root / name / "mcore", root / name / "roundtrip", logits)
    jobs = [(str(h), str(m), str(r)) for h, m, r, _ in out.values()]
    return root, out, run_distributed(_convert_and_load_tp1, 1, jobs, timeout=300)[0]


def _logits_on(path: str, layout):
    from earl_megatron.testing.logits import megatron_logits
    from earl_megatron.weights.convert import load_policy

    mol = load_policy(path, layout, ddp=False)
    mol.module().eval()
    got = megatron_logits(mol, _tokens())
    return mol, (None if got is None else got[1])


def _convert_and_load_tp1(jobs):
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf

    stats, logits = {}, {}
    for hf_dir, mcore_dir, rt_dir in jobs:
        # 40 kB parts: one layer's experts are 4 x 3 x 8 kB, so parts end inside them
        to_mcore = convert_hf_to_mcore(hf_dir, mcore_dir, part_bytes=40_000)
        to_hf = convert_mcore_to_hf(mcore_dir, rt_dir, part_bytes=40_000, max_shard_bytes=200_000)
        stats[hf_dir] = (to_mcore, to_hf)
        with cpu_backend():
            for path in (mcore_dir, hf_dir):
                logits[(path, "TP1")] = _logits_on(path, ParallelLayout())[1]
                groups.destroy_groups()
    return stats, logits


def _gather_hf(mol, bucket_bytes=None):
    """HF tensors from ``gather_full`` (or, with ``bucket_bytes``, the weight sync's buckets at
    its pushing ranks 1 and 3; None on the others)."""
    import torch.distributed as dist

    from earl_megatron.runtime.weight_transfer import full_weights_at
    from earl_megatron.weights import hf_mapping as hfm
    from earl_megatron.weights.gather import gather_full

    if bucket_bytes is None:
        return hfm.to_hf(mol.cfg, gather_full(mol.model, mol.cfg, mol.layout))
    full = {}
    for _, _, bucket in full_weights_at(mol, (1, 3), bucket_bytes):
        full.update(bucket or {})
    return hfm.to_hf(mol.cfg, full) if dist.get_rank() in (1, 3) else None


def _four_ranks(paths, hf_dir, ckpt_root):
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import local_microbatches, random_batch, train_step
    from earl_megatron.weights.convert import load_policy

    world = dist.get_world_size()
    out = {}
    with cpu_backend():
        for path in paths:
            for name in LAYOUTS:
                layout = ParallelLayout.parse(name, world_size=world)
                mol, logits = _logits_on(path, layout)
                if logits is not None:
                    out[(path, str(layout))] = logits
                if name in ROUND_TRIP and path.endswith("/hf"):
                    out[("gathered", path, name)] = _gather_hf(mol)
                    pushed = _gather_hf(mol, bucket_bytes=50_000)
                    if pushed is not None:
                        out[("buckets", path, name)] = pushed
                groups.destroy_groups()

        def step(mol, it):
            mbs = local_microbatches(random_batch(8, SEQ, 128, it), mol.layout, mol.coords, 2)
            return train_step(mol, mbs, seq_len=SEQ, micro_batch_size=2).loss

        spec = OptimizerSpec(lr=1e-3, use_distributed_optimizer=True)
        mol = load_policy(hf_dir, ParallelLayout.parse("ep2", world_size=world), optimizer=spec)
        for it in range(2):
            step(mol, it)
        saved = save_checkpoint(mol, ckpt_root, 2, {"iteration": 2})
        out["ep2_weights"] = _gather_hf(mol)
        out["ep2_losses"] = [step(mol, it) for it in range(2, 4)]
        groups.destroy_groups()
        mol = build_on_layout(mol.cfg, ParallelLayout.parse("dp4", world_size=world),
                              optimizer=spec, seed=99)
        out["dp4_random"] = _gather_hf(mol)
        load_checkpoint(mol, saved)
        out["dp4_weights"] = _gather_hf(mol)
        out["dp4_losses"] = [step(mol, it) for it in range(2, 4)]
        out["checkpoint"] = str(saved)
        groups.destroy_groups()
        # the plain optimizer's state keeps its chaining: DP4 -> EP2 is refused in one line
        plain = OptimizerSpec(lr=1e-3)
        mol = build_on_layout(mol.cfg, ParallelLayout.parse("dp4", world_size=world),
                              optimizer=plain)
        step(mol, 0)
        saved = save_checkpoint(mol, ckpt_root + "_plain", 1, {"iteration": 1})
        groups.destroy_groups()
        mol = build_on_layout(mol.cfg, ParallelLayout.parse("ep2", world_size=world),
                              optimizer=plain)
        try:
            load_checkpoint(mol, saved)
        except CheckpointError as e:
            out["plain_refused"] = str(e)
        groups.destroy_groups()
    return out


def _export(ckpt_dir, out_dir):
    from earl_megatron.weights.convert import convert_mcore_to_hf

    return convert_mcore_to_hf(ckpt_dir, out_dir, part_bytes=40_000).bytes


@pytest.fixture(scope="module")
def four_ranks(models):
    root, out, _ = models
    paths = [str(p) for h, m, _, _ in out.values() for p in (m, h)]
    hf_dir = str(out[MODELS[0]][0])
    results = run_distributed(_four_ranks, 4, paths, hf_dir, str(root / "train_ckpt"),
                              timeout=600)
    merged = {k: v for r in results for k, v in r.items()}
    return merged


def _max_diff(results, out, layouts):
    worst = {}
    for name, (hf_dir, mcore_dir, _, ref) in out.items():
        for path in (mcore_dir, hf_dir):
            for lay in layouts:
                got = results[(str(path), lay)]
                assert got.shape == ref.shape, (name, lay, got.shape)
                worst[(name, path.name, lay)] = (got - ref).abs().max().item()
    print("max |logit diff| vs transformers:", worst)
    return worst


def test_tp1_logits_and_round_trip_bit_exact(models):
    from transformers import AutoModelForCausalLM

    from earl_megatron.weights import hf_mapping as hfm

    _, out, (stats, logits) = models
    for key, diff in _max_diff(logits, out, ["TP1"]).items():
        assert diff < TOL, key
    for name, (hf_dir, _, rt_dir, ref) in out.items():
        orig, back = _hf_tensors(hf_dir), _hf_tensors(rt_dir)
        assert "model.layers.3.mlp.experts.3.up_proj.weight" in orig  # per-expert on disk
        assert sorted(orig) == sorted(back), name
        for t_name, t in orig.items():
            assert back[t_name].dtype == t.dtype and torch.equal(back[t_name], t), (name, t_name)
        orig_cfg = json.loads((hf_dir / "config.json").read_text())
        back_cfg = json.loads((rt_dir / "config.json").read_text())
        assert hfm.from_hf_config(back_cfg) == hfm.from_hf_config(orig_cfg)
        assert back_cfg["norm_topk_prob"] == (name == "norm_topk")
        model = AutoModelForCausalLM.from_pretrained(rt_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(model(_tokens()).logits.float(), ref), name
    for to_mcore, to_hf in stats.values():
        assert to_mcore.parts > 4 and to_hf.parts > 1   # parts ended inside layers' experts
        assert to_mcore.bytes == to_hf.bytes


def test_expert_layouts_logits_match_transformers(models, four_ranks):
    _, out, _ = models
    for key, diff in _max_diff(four_ranks, out, ["DP4", "EP2xDP4", "EP2xTP2xDP2",
                                                 "EP2xPP2xDP2"]).items():
        assert diff < TOL, key


def test_gather_from_ep_layouts_is_bit_exact(models, four_ranks):
    _, out, _ = models
    for name, (hf_dir, _, _, _) in out.items():
        orig = _hf_tensors(hf_dir)
        for lay in ROUND_TRIP:
            for how in ("gathered", "buckets"):
                got = four_ranks[(how, str(hf_dir), lay)]
                assert sorted(got) == sorted(orig), (name, lay, how)
                for t_name, t in orig.items():
                    assert torch.equal(got[t_name], t), (name, lay, how, t_name)


def test_checkpoint_saved_on_ep2_loads_on_ep1(models, four_ranks, tmp_path):
    from transformers import AutoModelForCausalLM

    saved, loaded = four_ranks["ep2_weights"], four_ranks["dp4_weights"]
    assert sorted(saved) == sorted(loaded)
    assert any(not torch.equal(four_ranks["dp4_random"][n], saved[n]) for n in saved)
    for n, t in saved.items():
        assert torch.equal(loaded[n], t), n
    assert four_ranks["ep2_losses"] == pytest.approx(four_ranks["dp4_losses"], abs=1e-5)
    assert "use_distributed_optimizer=true" in four_ranks["plain_refused"]
    # the trainer checkpoint exports to HF: the EP2 model's weights, bit-exact
    exported = tmp_path / "export"
    run_distributed(_export, 1, four_ranks["checkpoint"], str(exported), timeout=300)
    back = _hf_tensors(exported)
    assert sorted(back) == sorted(saved)
    for n, t in saved.items():
        assert torch.equal(back[n], t), n
    _, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32,
                                                   output_loading_info=True)
    assert not any(info.values()), info    # no missing, unexpected or mismatched tensor
