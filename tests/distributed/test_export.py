"""A trainer checkpoint exports to Hugging Face with tools/convert_mcore_to_hf.py, and the export
loads back (load_policy, any layout) with the trained weights bit-exact (the SGLang weight sync's
buckets: tests/distributed/test_weight_transfer.py)."""

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
