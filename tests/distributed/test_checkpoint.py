"""Checkpoints: save under one layout, load under another, and training continues on the same
trajectory (plain and distributed optimizer); interrupted writes leave the last one loadable;
saving leaves no helper process behind (runtime/checkpoint.save_sharded)."""

from earl_megatron.testing.multiproc import run_distributed

CASES = [("tp2-dp2", "pp2-dp2", False), ("dp4", "tp2-cp2", True), ("tp2-pp2", "dp4", True)]


def _resume_cases(root):
    import os

    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from earl_megatron.runtime.checkpoint_files import latest_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import local_microbatches, random_batch, train_step
    from earl_megatron.models.sharding import reference_weights

    cfg = ModelConfig.tiny()
    world = dist.get_world_size()

    def step(mol, it):
        mbs = local_microbatches(random_batch(8, 32, cfg.vocab_size, it), mol.layout, mol.coords, 2)
        return train_step(mol, mbs, seq_len=32, micro_batch_size=2).loss

    out = []
    with cpu_backend():
        for i, (a, b, dist_opt) in enumerate(CASES):
            d = os.path.join(root, f"case{i}")
            spec = OptimizerSpec(lr=1e-3, use_distributed_optimizer=dist_opt)
            mol = build_on_layout(cfg, ParallelLayout.parse(a, world_size=world, model=cfg),
                                  weights=reference_weights(cfg), optimizer=spec)
            for it in range(2):
                step(mol, it)
            save_checkpoint(mol, d, 2, {"iteration": 2, "note": a})
            reference = [step(mol, it) for it in range(2, 5)]
            groups.destroy_groups()
            mol = build_on_layout(cfg, ParallelLayout.parse(b, world_size=world, model=cfg),
                                  optimizer=spec)
            loop = load_checkpoint(mol, latest_checkpoint(d))
            resumed = [step(mol, it) for it in range(2, 5)]
            groups.destroy_groups()
            out.append((loop, max(abs(x - y) for x, y in zip(reference, resumed))))
        # a half-written checkpoint (no loop.json) is refused with a clear message
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(root, "broken", "iter_000001"))
            with open(os.path.join(root, "broken", "latest"), "w") as f:
                f.write("iter_000001")
        dist.barrier()
        try:
            latest_checkpoint(os.path.join(root, "broken"))
            out.append("no error")
        except CheckpointError as e:
            out.append(str(e))
    # Megatron's writer forks its file writers and joins them; without save_sharded's in-process
    # results queue a spawned Manager server would still be running here
    import psutil
    out.append([" ".join(c.cmdline()[:4]) for c in psutil.Process().children(recursive=True)])
    return out


def test_resume_across_layouts(tmp_path):
    results = run_distributed(_resume_cases, 4, str(tmp_path), timeout=400)[0]
    for (loop, diff), (a, b, dist_opt) in zip(results[:-2], CASES):
        assert loop == {"iteration": 2, "note": a}
        assert diff < 1e-6, (a, b, dist_opt, diff)
    assert "incomplete" in results[-2]
    assert results[-1] == [], f"processes left by the saves: {results[-1]}"
