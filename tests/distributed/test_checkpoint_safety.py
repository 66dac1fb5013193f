"""Checkpoints under Megatron's real save and load, on 2 ranks: keep_last leaves exactly the
newest folders, a re-save of the latest iteration that fails half way leaves the old weights
loadable (and a later re-save replaces them), and a truncated loop.json makes the resume fall
back to the newest complete checkpoint, with the weights of that iteration."""

from earl_megatron.testing.multiproc import run_distributed


def _safety(root):
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import checkpoint as ck
    from earl_megatron.runtime import checkpoint_files as ckf
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import local_microbatches, random_batch, train_step

    cfg, root = ModelConfig.tiny(), Path(root)
    spec = OptimizerSpec(lr=1e-2)
    rank = dist.get_rank()

    def build():
        return build_on_layout(cfg, ParallelLayout.parse("tp2", world_size=2, model=cfg),
                               optimizer=spec)

    def step(mol, it):
        mbs = local_microbatches(random_batch(4, 16, cfg.vocab_size, it), mol.layout,
                                 mol.coords, 2)
        train_step(mol, mbs, seq_len=16, micro_batch_size=2)

    def weights(mol):
        return {k: v.detach().clone() for k, v in mol.module().state_dict().items()
                if isinstance(v, torch.Tensor)}

    def diff(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)

    def loaded(path):
        mol = build()
        loop = ck.load_checkpoint(mol, path)
        w = weights(mol)
        groups.destroy_groups()
        return loop, w

    def names():
        return sorted(p.name for p in root.iterdir())

    out = {}
    with cpu_backend():
        mol = build()
        saved = {}
        for it in range(4):
            step(mol, it)
            ck.save_checkpoint(mol, root, it, {"iteration": it}, keep_last=2)
            saved[it] = weights(mol)
        out["after_keep_last"] = names()
        out["latest"] = (root / "latest").read_text()
        step(mol, 4)
        new = weights(mol)
        # re-save iteration 3 (latest) with the new weights; rank 0 fails as it would publish
        real = os.replace

        def fail_publish(a, b):
            if str(a).endswith("iter_000003.tmp"):
                raise OSError("injected: disk full at the publishing rename")
            return real(a, b)

        if rank == 0:
            os.replace = fail_publish
        try:
            ck.save_checkpoint(mol, root, 3, {"iteration": 3, "again": True}, keep_last=2)
            out["failed"] = None
        except OSError as e:
            out["failed"] = str(e)
            dist.barrier()  # the one the other rank waits on at the end of save_checkpoint
        finally:
            os.replace = real
        groups.destroy_groups()
        found = ckf.find_checkpoint(root)
        out["after_failure"] = (found.path.name, found.message())
        loop, w = loaded(found.path)
        out["failure_loads_old"] = (loop, diff(w, saved[3]))
        # a re-save that completes replaces it and removes the old copy
        mol = build()
        ck.load_checkpoint(mol, found.path)
        step(mol, 4)
        ck.save_checkpoint(mol, root, 3, {"iteration": 3, "again": True}, keep_last=2)
        groups.destroy_groups()
        out["after_resave"] = names()
        loop, w = loaded(ckf.latest_checkpoint(root))
        out["resave_loads_new"] = (loop, diff(w, new))
        # the newest loop.json truncated: the resume falls back to iteration 2, and says so
        if rank == 0:
            f = root / "iter_000003" / "loop.json"
            f.write_text(f.read_text()[:5])
        dist.barrier()
        found = ckf.find_checkpoint(root)
        out["fallback"] = (found.path.name, found.message())
        loop, w = loaded(found.path)
        out["fallback_loads"] = (loop, diff(w, saved[2]))
    return out


def test_keep_last_resave_failure_and_fallback_with_real_checkpoints(tmp_path):
    root = tmp_path / "ck"
    outs = run_distributed(_safety, 2, str(root), timeout=400)
    out = outs[0]
    assert out["after_keep_last"] == ["iter_000002", "iter_000003", "latest"]
    assert out["latest"] == "iter_000003"
    assert out["failed"] == "injected: disk full at the publishing rename"
    assert outs[1]["failed"] is None  # only rank 0 renames
    # the old copy of iteration 3 stayed complete: resume takes it and says why
    name, msg = out["after_failure"]
    assert name == "iter_000003.old"
    assert msg and f"{root / 'latest'} names {root / 'iter_000003'}, which does not exist" in msg
    loop, d = out["failure_loads_old"]
    assert loop == {"iteration": 3} and d == 0.0
    assert out["after_resave"] == ["iter_000002", "iter_000003", "latest"]
    loop, d = out["resave_loads_new"]
    assert loop == {"iteration": 3, "again": True} and d < 1e-6  # the same trajectory
    name, msg = out["fallback"]
    assert name == "iter_000002"
    assert f"{root / 'iter_000003' / 'loop.json'} is truncated or not JSON" in msg
    loop, d = out["fallback_loads"]
    assert loop == {"iteration": 2} and d == 0.0


def _cfg(out, iterations, **run):
    from earl_megatron.config.train import TrainConfig

    return TrainConfig.from_dict({
        "model": {"vocab_size": 32},
        "env": {"name": "connect_four", "kwargs": {"system_prompt": "", "legal_move_reward": 0.1},
                "eval_opponents": ["random"]},
        "rollout": {"episodes_per_iteration": 4, "max_turns": 4},
        "algorithm": {"micro_batch_size": 2},
        "run": {"iterations": iterations, "output_dir": str(out), "checkpoint_every": 1,
                "keep_last": 2, "eval_episodes": 2, "live_view": False, **run},
    })


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


def _lines(out):
    import json
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a, b):
    """Records equal but for wall time."""
    strip = ({k: v for k, v in r.items() if k != "seconds"} for r in (a, b))
    return next(strip) == next(strip)


def test_trainer_keeps_last_falls_back_and_never_truncates_metrics(tmp_path, capfd):
    import pytest

    out = tmp_path / "run"
    first = run_distributed(_train, 2, _cfg(out, 3), timeout=500)[0]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_000001", "iter_000002", "latest"]
    # the newest checkpoint damaged (a kill mid-copy, a full disk): the rerun resumes from
    # iteration 1's, says so once, and replays iteration 2 exactly
    loop = ckpts / "iter_000002" / "loop.json"
    loop.write_text(loop.read_text()[:100])
    capfd.readouterr()
    second = run_distributed(_train, 2, _cfg(out, 4), timeout=500)[0]
    text = capfd.readouterr().out
    assert text.count(f"resuming from {ckpts / 'iter_000001'}, the newest complete checkpoint; "
                      f"skipped {loop} is truncated or not JSON") == 1, text[-3000:]
    assert f"resumed from {ckpts / 'iter_000001'} at iteration 2" in text
    assert f"{out / 'metrics.jsonl'}: dropped the lines of iteration 2, recorded after the " \
        "checkpoint this run resumed from; it replays them" in text
    assert [h["iteration"] for h in second] == [0, 1, 2, 3]
    assert all(_same(a, b) for a, b in zip(first, second))
    assert [r["iteration"] for r in _lines(out)] == [0, 1, 2, 3]
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_000002", "iter_000003", "latest"]
    # a new run into the same folder is refused before anything is written
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(Exception, match=r"already holds a run \(metrics.jsonl, eval.json, "
                                        r"checkpoints/\) and run.resume=false"):
        run_distributed(_train, 2, _cfg(out, 2, resume=False), timeout=500)
    assert (out / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_000002", "iter_000003", "latest"]
