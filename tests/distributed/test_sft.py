"""The supervised warm start on a fixed file of calculator traces (tests/data): the loss falls,
and three layouts on 2 ranks (dp2, tp2, pp2) give the same loss at every step, from the same
initial weights, through the dispatcher and Megatron's schedules and optimizer."""

from pathlib import Path

from earl_megatron.testing.multiproc import run_distributed

TRACES = Path(__file__).resolve().parents[1] / "data" / "calculator_traces.jsonl"
STEPS, BATCH = 8, 16


def _sft_losses(path, layouts):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.config.sft import SFTConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.tokenizer import tool_tokenizer
    from earl_megatron.rollout.trajectories import read_jsonl
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.trainer.sft import tokenize_traces, train_sft
    from earl_megatron.trainer.stages import BatchShape
    from earl_megatron.models.sharding import reference_weights

    tok = tool_tokenizer()
    cfg = ModelConfig.tiny(vocab_size=64)
    samples = tokenize_traces(read_jsonl(path), tok, cfg.max_position_embeddings)
    scfg = SFTConfig(steps=STEPS, batch_size=BATCH)
    weights = reference_weights(cfg, seed=5)  # the same full weights, sharded per layout
    out = {}
    with cpu_backend():
        for name in layouts:
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            mol = build_on_layout(cfg, lay, weights=weights,
                                  optimizer=OptimizerSpec(lr=1.0))
            # lr=1.0 in the spec, 1e-2 set per step: the step's rate is the one that counts
            out[name] = train_sft(mol, samples, scfg, lr=1e-2, seed=0,
                                  pad_id=tok.pad_token_id,
                                  shape=BatchShape(micro_batch_size=4, micro_batch_tokens=128))
            out[name + "/lr"] = [g["lr"] for g in mol.optimizer.param_groups]
            groups.destroy_groups()
    return out


def test_sft_loss_falls_identically_on_three_layouts():
    per_rank = run_distributed(_sft_losses, 2, str(TRACES), ["dp2", "tp2", "pp2"], timeout=300)
    assert per_rank[0] == per_rank[1]  # every rank reports the global loss
    res = per_rank[0]
    ref = res["dp2"]
    assert len(ref) == STEPS
    # 64 ids: an untrained model starts near ln 64 = 4.16 nats per agent token
    assert 3.5 < ref[0] < 4.8
    assert ref[-1] < 0.75 * ref[0], ref
    for name in ("tp2", "pp2"):
        assert max(abs(a - b) for a, b in zip(ref, res[name])) < 1e-4, (name, res[name], ref)
        assert set(res[name + "/lr"]) == {1e-2}
