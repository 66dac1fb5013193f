"""HF <-> Megatron-Core conversion: logits under several layouts, bit-exact round trip.

Tiny random models are built with transformers from a config (no download) and saved:
Llama (untied, GQA 8 heads / 2 KV heads, rope base 5000, sharded safetensors with an index) and
Qwen2 (tied embeddings, qkv bias, 8 heads / 4 KV heads, one safetensors file), Qwen3 with odd
shapes (per-head q/k norms, head_dim 16 != hidden 48 / 6 heads, 2 KV heads, untied) and a tied
Qwen3 (head_dim 12, hidden 40, 8 heads / 2 KV heads). One launch per
world size: world 1 converts both ways and loads TP1; world 4 loads TP2, PP2 (each with dp=2) and
TP2xPP2 and checks that TP4 is refused before anything is loaded. Each layout loads both the
converted checkpoint (dist_checkpointing resharding on load) and the HF directory directly
(on-the-fly conversion of this rank's shards); logits must match transformers' within 1e-4.
"""

import json

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
BATCH, SEQ = 2, 16
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_tied")   # models, by family (and tying)


def _hf_model(family: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=8, max_position_embeddings=256, rms_norm_eps=1e-6)
    if family == "llama":
        cfg = LlamaConfig(num_key_value_heads=2, rope_theta=5000.0, **common)
    elif family == "qwen2":
        cfg = Qwen2Config(num_key_value_heads=4, tie_word_embeddings=True, **common)
    elif family == "qwen3":
        cfg = Qwen3Config(**dict(common, hidden_size=48, intermediate_size=96,
                                 num_attention_heads=6), num_key_value_heads=2, head_dim=16,
                          rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                          tie_word_embeddings=False)
    else:
        cfg = Qwen3Config(**dict(common, hidden_size=40, intermediate_size=80),
                          num_key_value_heads=2, head_dim=12, tie_word_embeddings=True)
    torch.manual_seed(FAMILIES.index(family) + 1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def _tokens():
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (hf_dir, mcore_dir, roundtrip_dir, reference logits)}, converted in world 1."""
    root = tmp_path_factory.mktemp("conversion")
    out = {}
    for family in FAMILIES:
        model = _hf_model(family)
        hf_dir = root / family / "hf"
        # llama in several shards with an index, qwen2 as one model.safetensors
        model.save_pretrained(hf_dir, max_shard_size="150KB" if family == "llama" else "50MB")
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
        with torch.no_grad():
            logits = model(_tokens()).logits.float()
        out[family] = (hf_dir, root / family / "mcore", root / family / "roundtrip", logits)
    jobs = [(str(h), str(m), str(r)) for h, m, r, _ in out.values()]
    results = run_distributed(_convert_and_load_tp1, 1, jobs, timeout=300)[0]
    return out, results


def _megatron_logits(mol, tokens: torch.Tensor):
    """Full-vocab logits on the last pp_stage's tp rank 0 (None elsewhere), Megatron schedules."""
    from earl_megatron.testing.logits import megatron_logits

    got = megatron_logits(mol, tokens)
    return None if got is None else got[1]


def _load_layouts(paths: list[str], layouts: list[str]) -> dict:
    """{(path, layout): logits} from the rank that holds them (None on other ranks)."""
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.convert import load_policy

    out = {}
    with cpu_backend():
        for path in paths:
            for name in layouts:
                layout = ParallelLayout.parse(name, world_size=dist.get_world_size())
                mol = load_policy(path, layout, ddp=False)
                logits = _megatron_logits(mol, _tokens())
                if logits is not None:
                    out[(path, str(layout))] = logits
                groups.destroy_groups()
    return out


def _convert_and_load_tp1(jobs):
    from earl_megatron.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf

    stats = {}
    for hf_dir, mcore_dir, rt_dir in jobs:
        # small parts so that the multi-part save and the metadata merge are exercised
        to_mcore = convert_hf_to_mcore(hf_dir, mcore_dir, part_bytes=100_000)
        to_hf = convert_mcore_to_hf(mcore_dir, rt_dir, part_bytes=100_000, max_shard_bytes=200_000)
        stats[hf_dir] = (to_mcore, to_hf)
    paths = [p for hf_dir, mcore_dir, _ in jobs for p in (mcore_dir, hf_dir)]
    logits = _load_layouts(paths, ["tp1"])
    # as the trainer loads: DDP-wrapped, with Megatron's distributed optimizer on top
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.convert import load_policy

    with cpu_backend():
        mol = load_policy(jobs[0][1], ParallelLayout(), ddp=True,
                          optimizer=OptimizerSpec(use_distributed_optimizer=True))
        logits[("ddp", jobs[0][1])] = _megatron_logits(mol, _tokens())
        groups.destroy_groups()
    return stats, logits


def _load_then_refuse(paths, layouts):
    from earl_megatron.plan.layout import InvalidLayoutError, ParallelLayout
    from earl_megatron.weights.convert import load_policy

    out = _load_layouts(paths, layouts)
    try:  # llama has 2 KV heads: tp4 cannot take it
        load_policy(paths[0], ParallelLayout(tp=4))
    except InvalidLayoutError as e:
        out["refused"] = str(e)
    return out


def _all_paths(out):
    return [str(p) for h, m, _, _ in out.values() for p in (m, h)]


def _check_logits(out, results, layouts):
    for family, (hf_dir, mcore_dir, _, ref) in out.items():
        for path in (mcore_dir, hf_dir):
            for lay in layouts:
                got = results[(str(path), lay)]
                assert got.shape == ref.shape, (family, lay, got.shape)
                diff = (got - ref).abs().max().item()
                assert diff < TOL, (family, str(path), lay, diff)


def test_tp1_logits_match_transformers(models):
    out, (stats, results) = models
    _check_logits(out, results, ["TP1"])
    _, mcore_dir, _, ref = out[FAMILIES[0]]
    assert (results[("ddp", str(mcore_dir))] - ref).abs().max().item() < TOL
    for to_mcore, to_hf in stats.values():
        assert to_mcore.parts > 1 and to_hf.parts > 1  # several saves merged, several reads
        assert to_mcore.bytes == to_hf.bytes  # every byte came back


def test_round_trip_is_bit_exact(models):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from earl_megatron.weights import hf_mapping as hfm

    out, _ = models
    for family, (hf_dir, _, rt_dir, ref) in out.items():
        orig = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
        back = {k: v for f in sorted(rt_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
        assert sorted(orig) == sorted(back), family
        for name, t in orig.items():
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), (family, name)
        assert len(list(rt_dir.glob("*.safetensors"))) > 1  # written in several shards
        assert (rt_dir / "model.safetensors.index.json").is_file()
        assert (rt_dir / "tokenizer_config.json").read_text() == \
            (hf_dir / "tokenizer_config.json").read_text()
        orig_cfg = json.loads((hf_dir / "config.json").read_text())
        back_cfg = json.loads((rt_dir / "config.json").read_text())
        assert hfm.from_hf_config(back_cfg) == hfm.from_hf_config(orig_cfg)
        for key in ("num_key_value_heads", "tie_word_embeddings", "architectures", "vocab_size"):
            assert back_cfg[key] == orig_cfg[key], (family, key)
        model = AutoModelForCausalLM.from_pretrained(rt_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(model(_tokens()).logits.float(), ref), family


def test_tp2_pp2_tp2xpp2_logits_and_refused_layout(models):
    out, _ = models
    # one 4-rank launch: TP2 and PP2 run with dp=2 (same logits on both replicas)
    layouts = ["tp2", "pp2", "tp2-pp2"]
    results = run_distributed(_load_then_refuse, 4, _all_paths(out), layouts, timeout=300)
    merged = {k: v for r in results for k, v in r.items()}
    _check_logits(out, merged, ["TP2xDP2", "PP2xDP2", "TP2xPP2"])
    assert "tp=4 does not divide num_query_groups=2" in merged["refused"]
