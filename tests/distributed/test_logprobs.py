"""The logits path (rl.vocab_parallel through runtime.step) against one process, per layout.

On the same weights and batch, for every layout:
  (a) forward_logprobs' logp == -CE of the labels path == full-vocab log_softmax at TP1,
  (b) the entropy handed to the loss == Categorical(full logits).entropy() at TP1,
  (c) the full gradients of  sum(mask * (-A * logp - 0.01 * entropy)) / tokens  and of the
      entropy term alone (both at temperature 0.8) equal the one-process gradients.
Per-rank results are scattered back to their global [sample, position] slots (dp rows, cp zigzag
positions) and summed over the world, so a slot filled twice or never shows up as a mismatch.
"""

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-5
GLOBAL_BATCH, SEQ, MBS, VOCAB = 4, 16, 1, 64


def _assemble(per_mb, batch, lay, coords):
    """[B, S] with this rank's micro-batch values in their global slots, summed over the world."""
    import torch.distributed as dist

    from earl_megatron.models.cp_attention import zigzag_positions

    full = torch.zeros(batch.num_samples, batch.seq_len, dtype=torch.float64)
    if per_mb and coords.tp == 0:
        per_dp = batch.num_samples // lay.dp
        pos = zigzag_positions(batch.seq_len, lay.cp, coords.cp)
        for m, t in enumerate(per_mb):
            r0 = coords.dp * per_dp + m * MBS
            full[r0:r0 + MBS][:, pos] = t.detach().double()
    dist.all_reduce(full)
    return full


def _run_layouts(layout_names):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import (TokenBatch, forward_backward,
                                            forward_backward_logprobs, forward_logprobs,
                                            local_microbatches, random_batch)
    from earl_megatron.weights.gather import gather_full
    from earl_megatron.models.sharding import reference_weights

    cfg = ModelConfig.tiny("llama", vocab_size=VOCAB, num_layers=2)
    weights = reference_weights(cfg, seed=7)
    b = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=3)
    adv = torch.randn(GLOBAL_BATCH, SEQ + 1, generator=torch.Generator().manual_seed(5))
    batch = TokenBatch(tokens=b.tokens, loss_mask=b.loss_mask, extras={"advantages": adv})
    out = {}
    with cpu_backend():
        for name in layout_names:
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            mol = build_on_layout(cfg, lay, weights=weights)
            mbs = local_microbatches(batch, lay, mol.coords, MBS)
            kw = dict(seq_len=SEQ, micro_batch_size=MBS)

            logp = _assemble(forward_logprobs(mol, mbs, **kw), batch, lay, mol.coords)

            ce = []
            forward_backward(mol.model, mol.tcfg, mbs, lay, forward_only=True,
                             loss_fn=lambda o, mb: ce.append(o.detach()) or o, **kw)
            ce = _assemble(ce, batch, lay, mol.coords)

            seen = []

            def rl_loss(tl, mb):
                seen.append(tl.entropy.detach())
                return -mb["advantages"] * tl.logp - 0.01 * tl.entropy

            res = forward_backward_logprobs(mol.model, mol.tcfg, mbs, lay, loss_fn=rl_loss,
                                            temperature=0.8, **kw)
            entropy_t08 = _assemble(seen, batch, lay, mol.coords)
            grads = gather_full(mol.model, cfg, lay,
                                what="grad")

            # the entropy term alone: its gradient is small next to the logp term's above
            forward_backward_logprobs(mol.model, mol.tcfg, mbs, lay, temperature=0.8,
                                      loss_fn=lambda tl, mb: -tl.entropy, **kw)
            grads_entropy = gather_full(mol.model, cfg, lay, what="grad")

            seen = []
            forward_backward_logprobs(mol.model, mol.tcfg, mbs, lay, forward_only=True,
                                      loss_fn=lambda tl, mb: seen.append(tl.entropy.detach())
                                      or tl.logp, **kw)
            entropy = _assemble(seen, batch, lay, mol.coords)

            ref = None
            if lay.world_size == 1:  # full logits: the ground truth for logp and entropy
                with torch.no_grad():
                    logits = mol.model(batch.tokens[:, :-1],
                                       torch.arange(SEQ).expand(GLOBAL_BATCH, -1), None).double()
                ref = dict(
                    logp=torch.log_softmax(logits, -1).gather(
                        -1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1),
                    entropy=torch.distributions.Categorical(logits=logits).entropy(),
                    entropy_t08=torch.distributions.Categorical(logits=logits / 0.8).entropy())
            groups.destroy_groups()
            if dist.get_rank() == 0:
                out[str(lay)] = dict(logp=logp, ce=ce, entropy=entropy, entropy_t08=entropy_t08,
                                     loss=res.loss, grads=grads, grads_entropy=grads_entropy,
                                     ref=ref)
    return out if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def reference():
    r = run_distributed(_run_layouts, 1, ["tp1"], timeout=120)[0]["TP1"]
    ref = r["ref"]
    # TP1 itself against plain torch on the full logits
    assert (r["logp"] - ref["logp"]).abs().max() < TOL
    assert (r["ce"] + ref["logp"]).abs().max() < TOL
    assert (r["entropy"] - ref["entropy"]).abs().max() < TOL
    assert (r["entropy_t08"] - ref["entropy_t08"]).abs().max() < TOL
    return r


LAYOUTS = {2: ["tp2", "cp2"], 4: ["tp2-pp2"]}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_logprobs_entropy_and_grads_match_one_process(reference, world):
    ref = reference["ref"]
    results = run_distributed(_run_layouts, world, LAYOUTS[world], timeout=150)[0]
    assert len(results) == len(LAYOUTS[world])
    for lay, r in results.items():
        assert (r["logp"] - ref["logp"]).abs().max() < TOL, lay           # (a)
        assert (r["logp"] + r["ce"]).abs().max() < TOL, lay               # (a) same layout
        assert (r["entropy"] - ref["entropy"]).abs().max() < TOL, lay     # (b)
        assert (r["entropy_t08"] - ref["entropy_t08"]).abs().max() < TOL, lay
        assert abs(r["loss"] - reference["loss"]) < TOL, lay
        assert r["grads"].keys() == reference["grads"].keys(), lay
        for key in ("grads", "grads_entropy"):                            # (c)
            for name, g in r[key].items():
                diff = (g - reference[key][name]).abs().max().item()
                assert diff < TOL, (lay, key, name, diff)
    for key in ("grads", "grads_entropy"):  # not trivially zero: errors would show above TOL
        assert max(g.abs().max().item() for g in reference[key].values()) > 100 * TOL, key
    # entropy is not trivially uniform or zero
    assert 0.5 < ref["entropy"].mean().item() < torch.log(torch.tensor(float(VOCAB))).item()
