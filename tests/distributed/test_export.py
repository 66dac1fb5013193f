"""A trainer checkpoint exports to Hugging Face with tools/convert_mcore_to_hf.py, and the export
loads back (load_policy, any layout) with the trained weights bit-exact; the SGLang weight sync's
bucketed gather returns the same tensors."""

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed


def _train_and_save(root):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.checkpoint import save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import local_microbatches, random_batch, train_step
    from earl_megatron.weights.gather import gather_full

    cfg = ModelConfig.tiny()
    with cpu_backend():
        lay = ParallelLayout.parse("tp2", world_size=dist.get_world_size(), model=cfg)
        mol = build_on_layout(cfg, lay, optimizer=OptimizerSpec(lr=1e-2), seed=3)
        mbs = local_microbatches(random_batch(4, 16, cfg.vocab_size, 0), lay, mol.coords, 2)
        train_step(mol, mbs, seq_len=16, micro_batch_size=2)
        path = save_checkpoint(mol, root, 0, {"iteration": 0})
        full = gather_full(mol.model, cfg, lay)
    return str(path), {k: v.clone() for k, v in full.items()}


def _load(hf_dir):
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.convert import load_policy
    from earl_megatron.weights.gather import gather_full

    with cpu_backend():
        mol = load_policy(hf_dir, ParallelLayout(tp=dist.get_world_size()), ddp=False)
        return gather_full(mol.model, mol.cfg, mol.layout)


def test_trainer_checkpoint_exports_to_hf(tmp_path):
    from earl_megatron.config.model import ModelConfig
    from earl_megatron.weights.convert import convert_mcore_to_hf, read_model_config

    path, trained = run_distributed(_train_and_save, 2, str(tmp_path / "ckpt"), timeout=200)[0]
    assert read_model_config(path) == ModelConfig.tiny()
    convert_mcore_to_hf(path, tmp_path / "hf")
    assert read_model_config(tmp_path / "hf") == ModelConfig.tiny()
    loaded = run_distributed(_load, 1, str(tmp_path / "hf"), timeout=200)[0]
    assert set(loaded) == set(trained)
    for k in trained:
        assert torch.equal(loaded[k], trained[k]), k


def _buckets(layouts, bucket_bytes):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.gather import gather_buckets, gather_full

    cfg = ModelConfig.tiny(tie_word_embeddings=False)
    out = []
    with cpu_backend():
        for name in layouts:
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            mol = build_on_layout(cfg, lay, ddp=False, seed=4)
            full = gather_full(mol.model, cfg, lay)
            seen, sizes, counts = {}, [], set()
            for i, n, bucket in gather_buckets(mol.model, cfg, lay, bucket_bytes):
                assert i == len(sizes) and not set(bucket) & set(seen)
                counts.add(n)
                sizes.append((len(bucket), sum(t.numel() * t.element_size()
                                               for t in bucket.values())))
                seen.update(bucket)
            same = set(seen) == set(full) and all(torch.equal(seen[k], full[k]) for k in full)
            out.append((name, same, sizes, counts))
            groups.destroy_groups()
    return out


def test_weight_sync_buckets_are_the_full_weights_bucket_by_bucket():
    # the SGLang weight sync's gather: under TP2 and PP2, the buckets together are exactly
    # gather_full's tensors, each bucket at most the cap unless one tensor alone exceeds it
    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.tensor_table import tensor_table
    from earl_megatron.weights.gather import weight_buckets

    cap = 40_000
    rows = tensor_table(ModelConfig.tiny(tie_word_embeddings=False)).full_rows
    plan = weight_buckets(rows, 4, cap)
    assert [r for b in plan for r in b] == list(rows)
    assert all(sum(r.numel for r in b) * 4 <= cap or len(b) == 1 for b in plan)
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        weight_buckets(rows, 4, 0)
    for name, same, sizes, counts in run_distributed(_buckets, 2, ["tp2", "pp2"], cap,
                                                     timeout=300)[0]:
        assert same, name
        assert counts == {len(plan)} and len(sizes) == len(plan) > 3, (name, sizes)
        assert all(b <= cap or k == 1 for k, b in sizes), (name, sizes)
