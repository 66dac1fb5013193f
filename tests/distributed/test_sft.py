"""The supervised warm start on a fixed file of calculator traces (tests/data), through what the
trainer runs (trainer/warm_start.WarmStart.run with the trainer's StagePlanner): the loss falls,
and three TRAIN layouts on 2 ranks (dp2, tp2, pp2) give the same loss at every step, from the
same initial weights, through the dispatcher and Megatron's schedules and optimizer."""

from pathlib import Path

from earl_megatron.testing.multiproc import run_distributed

TRACES = Path(__file__).resolve().parents[1] / "data" / "calculator_traces.jsonl"
STEPS, BATCH = 8, 16


def _sft_losses(path, out, layouts):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.config.sft import SFTConfig
    from earl_megatron.config.cluster import ClusterConfig
    from earl_megatron.config.train import LayoutConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.tokenizer import tool_tokenizer
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.trainer.model_pair import ModelPair
    from earl_megatron.trainer.planner import StagePlanner
    from earl_megatron.trainer.stages import BatchShape
    from earl_megatron.trainer.warm_start import TraceSource, WarmStart

    tok = tool_tokenizer()
    cfg = ModelConfig.tiny(vocab_size=64)
    scfg = SFTConfig(steps=STEPS, batch_size=BATCH, data=path, lr=1e-2, log_every=1)
    shape = BatchShape(micro_batch_size=4, micro_batch_tokens=128)
    weights = reference_weights(cfg, seed=5)  # the same full weights, sharded per layout
    world = dist.get_world_size()
    res = {}
    with cpu_backend():
        for name in layouts:
            lay = ParallelLayout.parse(name, world_size=world, model=cfg)
            models = ModelPair(build_on_layout(cfg, lay, weights=weights,
                                               optimizer=OptimizerSpec(lr=1.0)), None)
            planner = StagePlanner(cfg, LayoutConfig(mode="static", rollout=name,
                                                     logprob=name, train=name),
                                   ClusterConfig(), world, distributed_optimizer=False,
                                   episodes=BATCH, batch=shape)
            # lr=1.0 in the spec, sft.lr=1e-2 per step, then RL's rate (0.5) restored
            warm = WarmStart(scfg, TraceSource("calculator", {}, 0), tok, batch=shape,
                             rl_lr=0.5, max_tokens=cfg.max_position_embeddings,
                             out=Path(out) / name, checkpoint_every=0, rank=dist.get_rank(),
                             log=lambda line: None)
            assert warm.run(models, planner, lambda: False) is True
            res[name] = [h["loss"] for h in warm.history]
            res[name + "/layouts"] = sorted({h["layout"] for h in warm.history})
            res[name + "/lr"] = [g["lr"] for g in models.policy.optimizer.param_groups]
            groups.destroy_groups()
    return res


def test_sft_loss_falls_identically_on_three_layouts(tmp_path):
    per_rank = run_distributed(_sft_losses, 2, str(TRACES), str(tmp_path), ["dp2", "tp2", "pp2"],
                               timeout=300)
    assert per_rank[0] == per_rank[1]  # every rank reports the global loss
    res = per_rank[0]
    ref = res["dp2"]
    assert len(ref) == STEPS
    # 64 ids: an untrained model starts near ln 64 = 4.16 nats per agent token
    assert 3.5 < ref[0] < 4.8
    assert ref[-1] < 0.75 * ref[0], ref
    for name, shown in (("dp2", "DP2"), ("tp2", "TP2"), ("pp2", "PP2")):
        assert res[name + "/layouts"] == [shown]
        assert set(res[name + "/lr"]) == {0.5}
        if name != "dp2":
            assert max(abs(a - b) for a, b in zip(ref, res[name])) < 1e-4, (name, res[name], ref)
    # the last step is checkpointed where the trainer resumes a warm start from
    assert (tmp_path / "tp2" / "checkpoints" / "sft" / "iter_000007").is_dir()
