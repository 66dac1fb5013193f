"""PPO's critic (models/value_model.py) across layouts: one launch on 2 gloo ranks.

Two tiny policies, 2 layers each: Qwen2 (qkv bias; tied embeddings, so the critic's untying is
exercised) on DP2 (each rank the whole model), TP2, PP2 and CP2, and Qwen3-MoE on DP2 and TP2
(MoE with tp > 1 runs with sequence parallelism: the head's all-gather over tp). Each critic has
a seeded head. One packed batch (4 samples of 16 tokens, micro-batches of 1), on every layout:

  (a) runtime/step.forward_values equals, per [sample, position], the one-process forward of
      the whole batch (DP2's model called directly on rank 0: the TP1 reference), within the
      logprob layout tests' 1e-5; the values are not trivially 0;
  (b) the gradients of rl/value.value_loss (clipped at 0.2) through
      runtime/step.forward_backward_values, trunk and head gathered whole, equal DP2's within
      1e-5, and the head and every trunk tensor get a non-zero gradient; Megatron's Adam then
      steps (a CRITIC TRAIN step) with the same grad norm as DP2's (the head, replicated over
      tp, counted once);
  (c) the Qwen2 critic saved on TP2 after that step (runtime/checkpoint.save_checkpoint, Adam
      state included) and loaded on PP2 into a critic built from other weights and another
      head seed (every tensor differs before the load) gives back TP2's trunk and head
      bit-exact, and TP2's values after the step; the checkpoint holds the head as
      value_head.weight [1, hidden] and value_head.bias [1], no output layer;
  (d) building a critic with the policy's tied config is refused, naming critic_config;
  (e) that checkpoint exported by ``earl convert mcore-to-hf --critic`` (given the checkpoint
      and given a training checkpoint's layout, the critic under critic/ and the policy's
      config beside it) loads with ``AutoModelForTokenClassification`` as a
      Qwen2ForTokenClassification with one label whose logits are TP2's values after the step
      (1e-4), and its score is the head, bit-exact;
  (f) (a launch of its own) a policy-shaped algorithm.critic.init, an HF causal LM and its
      conversion, read in the critic's layout (weights/critic_import.py) equals the critic
      built from the same weights gathered whole, bit for bit.
"""

import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-5
GLOBAL_BATCH, SEQ, MBS, VOCAB = 4, 16, 1, 64
MODELS = {"qwen2": ["dp2", "tp2", "pp2", "cp2"], "qwen3_moe": ["dp2", "tp2"]}
CHECKPOINTED, SAVE_ON, LOAD_ON = "qwen2", "TP2", "PP2"


def _global(per_mb, lay, coords):
    """[B, S] float64: this rank's micro-batch values in their [sample, position] slots, summed
    over the world (a slot filled twice or never shows as a mismatch)."""
    import torch.distributed as dist

    from earl_megatron.models.cp_attention import zigzag_positions

    full = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.float64)
    if per_mb and coords.tp == 0:
        per_dp = GLOBAL_BATCH // lay.dp
        rows = torch.arange(coords.dp * per_dp, (coords.dp + 1) * per_dp)
        pos = zigzag_positions(SEQ, lay.cp, coords.cp)
        full[rows[:, None], pos[None, :]] = torch.cat(per_mb).double()
    dist.all_reduce(full)
    return full


def _critic_full(mol, cfg, what):
    """{name: full tensor} of the trunk (weights/gather.gather_full) and the head (whole on every
    rank of the last pp_stage, which must agree within TOL: the head is replicated over tp, dp
    and cp)."""
    import torch.distributed as dist

    from earl_megatron.models.value_model import CriticTrunk, value_head
    from earl_megatron.weights.gather import gather_full

    out = gather_full(CriticTrunk(mol.model), cfg, mol.layout, what=what)
    head = value_head(mol.model)
    mine = None if head is None else {
        f"value_head.{n}": (p.main_grad if what == "grad" else p).detach().float().clone()
        for n, p in head.named_parameters()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    heads = [p for p in parts if p is not None]
    for other in heads[1:]:
        for name, t in other.items():
            assert (t - heads[0][name]).abs().max() < TOL, (what, name, str(mol.layout))
    return {**out, **heads[0]}


def _run(ckpt_root):
    return {family: _family(family, names, ckpt_root) for family, names in MODELS.items()}


def _family(family, names, ckpt_root):
    import torch.distributed as dist

    from megatron.core import dist_checkpointing

    from earl_megatron.models.sharding import reference_weights, unwrap
    from earl_megatron.models.value_model import critic_config, critic_loader
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rl.value import value_loss
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.checkpoint import load_checkpoint, save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.step import (TokenBatch, forward_backward_values, forward_values,
                                            local_microbatches, random_batch)
    from earl_megatron.testing.tiny_models import tiny_model

    policy = tiny_model(family, vocab_size=VOCAB, num_layers=2)
    cfg = critic_config(policy)
    weights = reference_weights(policy, seed=7)
    b = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=3)
    g = torch.Generator().manual_seed(5)
    extras = {"returns": torch.randn(GLOBAL_BATCH, SEQ + 1, generator=g) * 0.3,
              "old_values": torch.randn(GLOBAL_BATCH, SEQ + 1, generator=g) * 0.1}
    batch = TokenBatch(tokens=b.tokens, loss_mask=b.loss_mask, extras=extras)
    kw = dict(seq_len=SEQ, micro_batch_size=MBS)

    def loss(values, mb):
        return value_loss(values, mb["old_values"], mb["returns"], mb["loss_mask"], clip=0.2)

    def build(lay, weights, seed):
        mol = build_on_layout(cfg, lay, load=critic_loader(weights, cfg, lay), seed=seed,
                              optimizer=OptimizerSpec(lr=1e-3))
        return mol, local_microbatches(batch, lay, mol.coords, MBS, model=cfg)

    out = {"tied": "output_layer.weight" not in weights}
    with cpu_backend():
        for name in names:
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            mol, mbs = build(lay, weights, 11)
            r = {"values": _global(forward_values(mol, mbs, **kw), lay, mol.coords),
                 "sequence_parallel": mol.tcfg.sequence_parallel}
            if lay.dp == 2 and dist.get_rank() == 0:   # the whole model on one rank
                with torch.no_grad():
                    r["reference"] = unwrap(mol.model)(
                        batch.tokens[:, :-1], torch.arange(SEQ).expand(GLOBAL_BATCH, -1),
                        None)[..., 0].double()
            mol.optimizer.zero_grad()   # a CRITIC TRAIN step, ordered as step.train_step's
            res = forward_backward_values(mol.model, mol.tcfg, mbs, lay, loss_fn=loss, **kw)
            r.update(loss=res.loss, grads=_critic_full(mol, cfg, "grad"))
            ok, r["grad_norm"], _ = mol.optimizer.step()
            assert ok
            if family == CHECKPOINTED and str(lay) == SAVE_ON:
                r["params"] = _critic_full(mol, cfg, "param")
                r["stepped_values"] = _global(forward_values(mol, mbs, **kw), lay, mol.coords)
                saved = save_checkpoint(mol, ckpt_root, 1, {"iteration": 1})
                r["stored"] = {k: tuple(t.global_shape) for k, t in
                               dist_checkpointing.load_tensors_metadata(str(saved)).items()
                               if k.startswith(("value_head.", "output_layer."))}
            groups.destroy_groups()
            out[str(lay)] = r
        if family == CHECKPOINTED:
            lay = ParallelLayout.parse("dp2", world_size=dist.get_world_size(), model=cfg)
            try:   # the policy's (tied) config where the critic's belongs
                build_on_layout(policy, lay, load=critic_loader(weights, policy, lay))
            except ValueError as e:
                out["refusal"] = str(e)
            groups.destroy_groups()
            lay = ParallelLayout.parse(LOAD_ON, world_size=dist.get_world_size(), model=cfg)
            mol, mbs = build(lay, reference_weights(policy, seed=8), 12)
            before = _critic_full(mol, cfg, "param")
            load_checkpoint(mol, saved)
            out["loaded"] = dict(before=before, after=_critic_full(mol, cfg, "param"),
                                 values=_global(forward_values(mol, mbs, **kw), lay, mol.coords))
            groups.destroy_groups()
    return out if dist.get_rank() == 0 else None


def test_critic_values_gradients_and_checkpoint_across_layouts(tmp_path):
    results = run_distributed(_run, 2, str(tmp_path), timeout=240)[0]
    for family, names in MODELS.items():
        out = results[family]
        ref = out["DP2"]
        assert (ref["values"] - ref["reference"]).abs().max() < TOL, family       # (a)
        assert ref["values"].abs().max() > 100 * TOL, family
        for lay in (k for k in out if k not in ("DP2", "tied", "loaded", "refusal")):
            r = out[lay]
            assert (r["values"] - ref["reference"]).abs().max() < TOL, (family, lay)  # (a)
            assert abs(r["loss"] - ref["loss"]) < TOL, (family, lay)
            # Megatron's grad norm counts the head (replicated over tp) once on every layout
            assert abs(r["grad_norm"] - ref["grad_norm"]) < TOL, (family, lay)
            assert r["grads"].keys() == ref["grads"].keys(), (family, lay)            # (b)
            for name, grad in r["grads"].items():
                diff = (grad - ref["grads"][name]).abs().max().item()
                assert diff < TOL, (family, lay, name, diff)
        assert {"value_head.weight", "value_head.bias"} <= ref["grads"].keys()
        assert "output_layer.weight" not in ref["grads"]
        # at least 10x the tolerance: a layout's wrong gradient would show (the smallest, the
        # norms' weights, are ~5e-4 here)
        dead = [n for n, grad in ref["grads"].items() if not grad.abs().max() > 10 * TOL]
        assert not dead, f"{family}: no gradient reaches {dead}"
    assert results[CHECKPOINTED]["tied"]            # the critic unties; it never reads one
    assert "build_on_layout(critic_config(cfg)" in results[CHECKPOINTED]["refusal"]
    assert results["qwen3_moe"]["TP2"]["sequence_parallel"]   # the head's gather ran
    saved, loaded = results[CHECKPOINTED][SAVE_ON]["params"], results[CHECKPOINTED]["loaded"]
    # the head under its own keys, whole: a policy checkpoint (output_layer.weight) cannot load
    hidden = saved["value_head.weight"].shape[1]
    assert results[CHECKPOINTED][SAVE_ON]["stored"] == {"value_head.weight": (1, hidden),
                                                        "value_head.bias": (1,)}
    assert loaded["after"].keys() == saved.keys()                                 # (c)
    for name, t in saved.items():
        assert not torch.equal(loaded["before"][name], t), name
        assert torch.equal(loaded["after"][name], t), name
    stepped = results[CHECKPOINTED][SAVE_ON]["stepped_values"]
    assert (loaded["values"] - stepped).abs().max() < TOL
    assert (stepped - results[CHECKPOINTED]["DP2"]["reference"]).abs().max() > 100 * TOL
    _check_hf_export(tmp_path, results[CHECKPOINTED][SAVE_ON])


def _check_hf_export(tmp_path, saved_on):
    """(e): the critic checkpoint through the exporter and transformers."""
    import shutil

    from transformers import AutoModelForTokenClassification

    from earl_megatron.runtime.checkpoint import CONFIG_JSON
    from earl_megatron.runtime.checkpoint_files import checkpoint_dir
    from earl_megatron.runtime.step import random_batch
    from earl_megatron.testing.peft_check import export
    from earl_megatron.testing.tiny_models import tiny_model

    saved = checkpoint_dir(tmp_path, 1)
    # a training checkpoint's layout: iter_N/critic/ and the policy's (tied) config in iter_N
    run_ckpt = tmp_path / "run" / "iter_000002"
    shutil.copytree(saved, run_ckpt / "critic")
    (run_ckpt / CONFIG_JSON).write_text((saved / CONFIG_JSON).read_text().replace(
        '"tie_word_embeddings": false', '"tie_word_embeddings": true'))
    assert tiny_model(CHECKPOINTED).tie_word_embeddings
    tokens = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=3).tokens[:, :-1]
    for src, out in ((saved, tmp_path / "hf_critic"), (run_ckpt, tmp_path / "hf_run_critic")):
        export(str(src), str(out), "--critic")
        model = AutoModelForTokenClassification.from_pretrained(str(out)).eval()
        assert type(model).__name__ == "Qwen2ForTokenClassification" and \
            model.config.num_labels == 1 and not model.config.tie_word_embeddings
        with torch.no_grad():
            values = model(tokens).logits[..., 0].double()
        diff = (values - saved_on["stepped_values"]).abs().max().item()
        assert diff < 1e-4, (str(src), diff)
        head = saved_on["params"]
        assert torch.equal(model.score.weight.float(), head["value_head.weight"])
        assert torch.equal(model.score.bias.float(), head["value_head.bias"])



def _inits_in_own_layout(hf_dir, mcore_dir, peft_dir, peft_merged):
    """{(layout, init): equal}: the critic built by critic_import's fill from each
    policy-shaped init against the one built from the same weights whole (bit for bit), and
    the critic from a PEFT adapter (trainer/critic.build_critic: loaded as a policy in the
    critic's layout, merged on each shard) against PEFT's own merge (1e-6)."""
    import dataclasses

    import torch.distributed as dist

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.models.value_model import critic_config, critic_loader
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.testing.tiny_models import tiny_model
    from earl_megatron.config.critic import CriticConfig
    from earl_megatron.config.train import TrainConfig
    from earl_megatron.trainer.critic import _as_policy, copied_from
    from earl_megatron.weights.critic_import import critic_init

    policy = tiny_model(CHECKPOINTED, vocab_size=VOCAB, num_layers=2)
    cfg = critic_config(policy)
    out = {}
    with cpu_backend():
        for name in ("pp2", "tp2"):
            lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
            ref = _critic_full(build_on_layout(cfg, lay, load=critic_loader(
                reference_weights(policy, seed=7), cfg, lay), seed=11), cfg, "param")
            groups.destroy_groups()
            for init in (hf_dir, mcore_dir):
                what, fill = critic_init(init, policy, lay)
                got = _critic_full(build_on_layout(cfg, lay, load=critic_loader(
                    None, cfg, lay, fill=fill), seed=11), cfg, "param")
                groups.destroy_groups()
                out[(name, what.split()[4])] = (got.keys() == ref.keys() and
                                                all(torch.equal(got[k], ref[k]) for k in ref))
            base = TrainConfig()
            cfg_init = dataclasses.replace(
                base, model=policy, run=dataclasses.replace(base.run, seed=11),
                algorithm=dataclasses.replace(base.algorithm, name="ppo",
                                              critic=CriticConfig(init=peft_dir)))
            fill = copied_from(_as_policy(cfg_init, lay, None))
            got = _critic_full(build_on_layout(cfg, lay, load=critic_loader(
                None, cfg, lay, fill=fill), seed=11), cfg, "param")
            groups.destroy_groups()
            ref = _critic_full(build_on_layout(cfg, lay, load=critic_loader(
                torch.load(peft_merged), cfg, lay), seed=11), cfg, "param")
            groups.destroy_groups()
            out[(name, "peft")] = got.keys() == ref.keys() and max(
                (got[k] - ref[k]).abs().max().item() for k in ref) < 1e-6
    return out


def test_a_policy_shaped_critic_init_is_read_in_the_critics_own_layout(tmp_path):
    """(f) algorithm.critic.init as an HF causal LM and as its conversion: each rank reads its
    shard of the trunk in the critic's layout (PP2, TP2), no whole model gathered, and the
    critic equals the one built from the same weights gathered whole, bit for bit, head
    included (the seeded one); as a PEFT adapter (random A and B on q, v, o and the MLP), the
    trunk merged on each shard equals peft's own merge_and_unload (1e-6)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.testing.peft_check import peft_adapter
    from earl_megatron.testing.tiny_models import tiny_model
    from earl_megatron.weights.convert import convert_hf_to_mcore
    from earl_megatron.weights.hf_io import write_hf_dir
    from earl_megatron.weights.hf_mapping import to_hf, to_hf_config, to_megatron

    policy = tiny_model(CHECKPOINTED, vocab_size=VOCAB, num_layers=2)
    write_hf_dir(tmp_path / "hf", to_hf(policy, reference_weights(policy, seed=7)),
                 to_hf_config(policy))
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore")
    base, adapter = peft_adapter(tmp_path / "peft", policy,
                                 ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"])
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32), adapter).merge_and_unload()
    torch.save(to_megatron(policy, hf.state_dict()), tmp_path / "peft_merged.pt")
    out = run_distributed(_inits_in_own_layout, 2, str(tmp_path / "hf"),
                          str(tmp_path / "mcore"), str(adapter), str(tmp_path / "peft_merged.pt"),
                          timeout=240)[0]
    assert out == {(lay, kind): True for lay in ("pp2", "tp2")
                   for kind in ("HF", "converted", "peft")}
