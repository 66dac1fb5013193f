"""Recompute modes on live models: same training, and the bytes the memory model predicts.

ONE launch on 4 gloo ranks. For each layout (TP2, CP2, PP2 of the tiny Qwen2; EP2xTP2 of the
tiny Qwen3-MoE, which runs under sequence parallelism) every rank builds the model twice, with
k = 1 and k = 2 layers per pp_stage, ONCE each, and runs one training forward/backward per
recompute mode, switching the mode on the live model with ``runtime.recompute.set_recompute``
(none -> selective -> full: the trainer's own switch, no rebuild). During each step autograd's
saved-tensor hooks record every non-parameter storage saved for backward (each storage once,
held until the step ends so an address is never reused), split into the forward phase (what
stays stored until the backward) and the backward phase (what the recomputation rebuilds).
The k = 2 minus k = 1 difference is what ONE layer saves on this rank, free of the embedding,
the logits and tensors the layers share (mask, rotary table).

Asserted:
- loss and every gradient (gathered to full tensors) of selective and full EQUAL the run
  without recompute (same model, same batch; differences are printed);
- dense layouts: per layer, forward-phase bytes == ``train_layer_bytes(...).stored`` and
  backward-phase bytes == ``.transient`` exactly, in every mode (fp32);
- MoE (routing decides how many token copies each expert keeps, the model assumes an even
  routing): full's stored input is exact (tokens/tp under sequence parallelism), and what
  selective saves against none is exact (the attention part, independent of the routing).

Wall time: ~30 s of CPU over the 4 ranks plus the launch.
"""

import pytest

from earl_megatron.testing.multiproc import run_distributed

WORLD, SEQ = 4, 32
MODES = ("none", "selective", "full")
CASES = (("qwen2", "tp2"), ("qwen2", "cp2"), ("qwen2", "pp2"), ("qwen3_moe", "ep2xtp2"))


def _step_bytes(mol, lay, mbs):
    """(loss, forward-phase bytes, backward-phase bytes) of one training step."""
    import torch

    from earl_megatron.runtime.step import forward_backward

    params = {p.untyped_storage().data_ptr() for p in mol.model.parameters()}
    seen = {False: {}, True: {}}
    phase = [False]
    real_backward = torch.autograd.backward

    def backward(*args, **kwargs):   # the schedules' (and the checkpoint's) backward calls
        outer, phase[0] = phase[0], True
        try:
            return real_backward(*args, **kwargs)
        finally:
            phase[0] = outer

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[phase[0]].setdefault(st.data_ptr(), (st.nbytes(), t))   # held: no reuse
        return t

    mol.model.zero_grad_buffer()
    torch.autograd.backward = backward
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = forward_backward(mol.model, mol.tcfg, mbs, lay, seq_len=SEQ, micro_batch_size=1)
    finally:
        torch.autograd.backward = real_backward
    return (res.loss, sum(n for n, _ in seen[False].values()),
            sum(n for n, _ in seen[True].values()))


def _run_cases(cases):
    import dataclasses

    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.activations import train_layer_bytes
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.specs import Recompute
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.recompute import recompute_of, set_recompute
    from earl_megatron.runtime.step import local_microbatches, random_batch
    from earl_megatron.weights.gather import gather_full

    rows = []
    with cpu_backend():
        for family, name in cases:
            base = ModelConfig.tiny(family)
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=base)
            batch = random_batch(lay.dp, SEQ, base.vocab_size, seed=3)
            measured = {}
            for k in (2, 1):        # MoE: Megatron's aux-loss tracker is sized by the first
                cfg = dataclasses.replace(base, num_layers=k * lay.pp)
                mol = build_on_layout(cfg, lay, weights=reference_weights(cfg, seed=7))
                mbs = local_microbatches(batch, lay, mol.coords, 1, model=cfg)
                for mode in MODES:
                    set_recompute(mol, mode)
                    assert recompute_of(mol) == mode
                    loss, fwd, bwd = _step_bytes(mol, lay, mbs)
                    grads = gather_full(mol.model, cfg, lay, what="grad") if k == 2 else None
                    measured[k, mode] = (loss, fwd, bwd, grads)
                groups.destroy_groups()
            for mode in MODES:
                model = train_layer_bytes(base, lay, SEQ, SEQ, 4, fused_attention=False,
                                          recompute=Recompute(mode))
                loss, fwd2, bwd2, grads = measured[2, mode]
                _, fwd1, bwd1, _ = measured[1, mode]
                ref_loss, *_, ref_grads = measured[2, "none"]
                rows.append(dict(
                    family=family, layout=str(lay), mode=mode, rank=dist.get_rank(),
                    stored=fwd2 - fwd1, transient=bwd2 - bwd1,
                    model_stored=model.stored, model_transient=model.transient,
                    loss_diff=abs(loss - ref_loss), loss=loss,
                    grad_diff=None if grads is None else max(
                        (g - ref_grads[n]).abs().max().item() for n, g in grads.items()),
                    grad_names=None if grads is None else sorted(grads) == sorted(ref_grads)))
    return rows


@pytest.fixture(scope="module")
def rows():
    per_rank = run_distributed(_run_cases, WORLD, CASES, timeout=300)
    out = [r for rank_rows in per_rank for r in rank_rows]
    for r in out:
        print(f"{r['family']} {r['layout']} {r['mode']} rank {r['rank']}: stored {r['stored']}"
              f"/{r['model_stored']} transient {r['transient']}/{r['model_transient']} "
              f"loss diff {r['loss_diff']:.1e} grad diff {r['grad_diff']}")
    return out


def test_every_case_ran_on_every_rank(rows):
    assert len(rows) == len(CASES) * len(MODES) * WORLD


def test_loss_and_grads_equal_without_recompute(rows):
    for r in rows:
        assert r["loss_diff"] == 0.0, r
        assert r["grad_names"] and r["grad_diff"] == 0.0, r    # full gradients, every rank


def test_dense_saved_bytes_equal_the_memory_model(rows):
    dense = [r for r in rows if r["family"] == "qwen2"]
    for r in dense:
        assert r["stored"] == r["model_stored"], r
        assert r["transient"] == r["model_transient"], r
    # the modes really differ: full keeps one layer input, selective less than none
    by = {(r["layout"], r["mode"], r["rank"]): r["stored"] for r in dense}
    for (lay, mode, rank), stored in by.items():
        if mode == "none":
            assert stored > by[lay, "selective", rank] > by[lay, "full", rank], lay


def test_moe_recompute_savings_equal_the_memory_model(rows):
    moe = {(r["mode"], r["rank"]): r for r in rows if r["family"] == "qwen3_moe"}
    for rank in range(WORLD):
        none, sel, full = (moe[m, rank] for m in MODES)
        assert full["stored"] == full["model_stored"] == SEQ // 2 * 64 * 4, full  # tokens/tp
        assert none["stored"] - sel["stored"] == none["model_stored"] - sel["model_stored"], \
            (none, sel)
