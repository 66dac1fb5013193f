"""LoRA through checkpoints and the trainer (model.lora): one 2-rank launch.

Checkpoints (models/lora.py ``LoraLinear.sharded_state_dict``), tiny Llama, rank 4, all four
targets, B set from seeded full tensors so that every adapter is nonzero:

- the base's entries of a LoRA model's sharded state dict are an un-adapted model's, key for
  key (same checkpoint key, shape, offsets, replica ids; SwiGLU's factory on fc1), the only
  new entries being ``lora_a`` / ``lora_b`` per adapted linear;
- saved on tp2 and loaded on tp1 (dp2), the adapters (assembled over tp) and the base come
  back bit-exact; saved again on tp1 and loaded on tp2, they equal the first tp2 model's
  bit-exact;
- the LoRA checkpoint loads into an un-adapted model as a full one would (its base);
- ``merged_weights`` of the adapted model (what PPO's critic starts from) built as an
  un-adapted model gives the adapted model's logits (1e-5), not the base's
  (its export as a PEFT adapter: tests/distributed/test_peft_export.py); the critic's trunk
  merged shard by shard on the policy's tp2 ranks (trainer/critic.py ``copied_from``) equals
  that gathered merge's shards (1e-6).

The trainer: tiny_connect_four with model.lora.rank=4 on one static tp2 layout, KL in the loss
(the reference is the base), PPO (issue #45: the critic beside a LoRA policy is a full model of
the base's trunk, every parameter trained), 3 iterations: every adapter changed, every base
parameter bit-identical to the seed's initial model, the value metrics finite; a run of 2
iterations resumed to 3 records the same iterations (every metric but the timings) as the
uninterrupted run. The checkpoint exports as a PEFT adapter and, with --critic, as a value
model with no adapter names.
"""

import json
import math
import re

import pytest

from earl_megatron.testing.configs import tiny_connect_four
from earl_megatron.testing.multiproc import run_distributed

LAYOUT = {"mode": "static", "rollout": "tp2", "logprob": "tp2", "train": "tp2"}
ADAPTED = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.")


def _describe(sh):
    """What makes a checkpoint entry the same entry: its kind, key and placement."""
    return (type(sh).__name__, sh.key, *(getattr(sh, a, None) for a in (
        "global_shape", "global_offset", "replica_id", "axis_fragmentations", "local_shape")))


def _checkpoints(root):
    import torch
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.lora import LoraSpec, lora_layers
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import load_checkpoint, save_checkpoint

    cfg = ModelConfig.tiny(vocab_size=32, lora=LoraSpec(rank=4, alpha=8))
    weights = reference_weights(cfg.base, seed=7)

    def build(name, model=cfg, **kw):
        lay = ParallelLayout.parse(name, world_size=dist.get_world_size(), model=cfg)
        return build_on_layout(model, lay, ddp=False, **kw)

    def adapters(mol):
        return {n: (m.gather_full("lora_a", m.lora_a), m.gather_full("lora_b", m.lora_b))
                for n, m in lora_layers(mol.model).items()}

    def local(mol):
        return {k: v.detach().clone() for k, v in mol.model.state_dict().items()
                if not k.endswith("_extra_state")}

    def full_base_equal(mol):
        """On tp1 each base tensor is the whole reference tensor, under the base's name."""
        state = local(mol)
        return all(torch.equal(state[ADAPTED.sub(r".\1.base.", n)] if ADAPTED.search(n)
                               else state[n], w) for n, w in weights.items())

    out = {}
    src = build("tp2", weights=weights, seed=11)
    for name, m in lora_layers(src.model).items():
        gen = torch.Generator().manual_seed(len(name))
        m.load_full(b=torch.randn(m.out_features, 4, generator=gen))
    full, src_local = adapters(src), local(src)
    out["adapters_nonzero"] = all(b.abs().max() > 0 for _, b in full.values())
    plain = build("tp2", model=cfg.base, weights=weights)
    lora_sd, plain_sd = src.model.sharded_state_dict(), plain.model.sharded_state_dict()
    out["base_entries_same"] = all(
        _describe(v) == _describe(lora_sd[ADAPTED.sub(r".\1.base.", k)])
        for k, v in plain_sd.items())
    extra = sorted(set(lora_sd) - {ADAPTED.sub(r".\1.base.", k) for k in plain_sd})
    out["extra"] = (len(extra), all(k.endswith((".lora_a", ".lora_b")) for k in extra))
    ckpt2 = save_checkpoint(src, f"{root}/tp2", 0, {"iteration": 0})

    dst = build("tp1", seed=99)        # other adapters (A) and a random base before the load
    out["differs_before"] = not full_base_equal(dst)
    load_checkpoint(dst, ckpt2)
    back = adapters(dst)
    out["tp2_to_tp1"] = full_base_equal(dst) and all(
        torch.equal(back[n][i], full[n][i]) for n in full for i in (0, 1))
    ckpt1 = save_checkpoint(dst, f"{root}/tp1", 0, {"iteration": 0})
    again = build("tp2", seed=99)
    load_checkpoint(again, ckpt1)
    again_local = local(again)
    out["tp1_to_tp2"] = again_local.keys() == src_local.keys() and all(
        torch.equal(again_local[k], v) for k, v in src_local.items())
    # PPO's critic starts from the policy as it acts: a model of the base's shape built from
    # merged_weights (the adapters merged in) computes the LoRA model's logits
    from earl_megatron.testing.logits import megatron_logits
    from earl_megatron.weights.gather import gather_full
    from earl_megatron.weights.peft_export import merged_weights

    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(3))
    merged = build("tp2", model=cfg.base,
                   weights=merged_weights(gather_full(src.model, cfg, src.layout), cfg))
    want, got = megatron_logits(src, tokens), megatron_logits(merged, tokens)
    base_logits = megatron_logits(plain, tokens)
    out["merged_acts_as_adapted"] = want is None or (
        (got[1] - want[1]).abs().max().item() < 1e-5 and
        (base_logits[1] - want[1]).abs().max().item() > 1e-3)
    # the critic's trunk merged shard by shard on the policy's own ranks (trainer/critic.py
    # copied_from) equals the gathered merge's shards
    from earl_megatron.models.value_model import CriticTrunk, critic_config, critic_loader
    from earl_megatron.trainer.critic import copied_from

    ccfg = critic_config(cfg)
    local_critic = build_on_layout(ccfg, src.layout, load=critic_loader(
        None, ccfg, src.layout, fill=copied_from(src)))
    gathered_critic = build_on_layout(ccfg, src.layout, load=critic_loader(
        merged_weights(gather_full(src.model, cfg, src.layout), cfg), ccfg, src.layout))
    a, b = (dict(CriticTrunk(m.model).named_parameters()) for m in (local_critic,
                                                                     gathered_critic))
    out["critic_merged_on_shards"] = a.keys() == b.keys() and max(
        (a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-6
    base_only = build("tp1", model=cfg.base, seed=5)
    load_checkpoint(base_only, ckpt2)
    out["base_loads_as_full"] = all(torch.equal(base_only.model.state_dict()[n], w)
                                    for n, w in weights.items())
    return out


def _training(root):
    import torch
    import torch.distributed as dist

    from earl_megatron.models.lora import lora_layers
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import load_checkpoint
    from earl_megatron.runtime.checkpoint_files import checkpoint_dir
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.train import run

    def cfg(out, iterations):
        return tiny_connect_four(out, model={"lora": {"rank": 4, "alpha": 8}}, layout=LAYOUT,
                                 algorithm={"kl_mode": "loss", "kl_coef": 0.1, "name": "ppo",
                                            "critic": {"lr": 1e-2}},
                                 run={"iterations": iterations})

    full_cfg = cfg(f"{root}/full", 3)
    full = run(full_cfg)
    run(cfg(f"{root}/resumed", 2))
    resumed = run(cfg(f"{root}/resumed", 3))

    lay = ParallelLayout.parse("tp2", world_size=dist.get_world_size(), model=full_cfg.model)
    with cpu_backend():
        start = build_on_layout(full_cfg.model, lay, ddp=False, seed=full_cfg.run.seed)
        end = build_on_layout(full_cfg.model, lay, ddp=False, seed=full_cfg.run.seed)
        load_checkpoint(end, checkpoint_dir(f"{root}/full/checkpoints", 2))
    s, e = start.model.state_dict(), end.model.state_dict()
    adapter_keys = {f"{n}.{w}" for n in lora_layers(start.model) for w in ("lora_a", "lora_b")}
    tensors = [k for k in s if not k.endswith("_extra_state")]
    strip = lambda hs: [{k: v for k, v in h.items() if k != "seconds"} for h in hs]  # noqa: E731
    return {
        "base_unchanged": all(torch.equal(s[k], e[k]) for k in tensors if k not in adapter_keys),
        "adapters_changed": all(not torch.equal(s[k], e[k]) for k in adapter_keys),
        "n_adapters": len(adapter_keys),
        "iterations": ([h["iteration"] for h in full], [h["iteration"] for h in resumed]),
        "records_equal": strip(full) == strip(resumed),
        "kl_recorded": all("kl" in h for h in full),
        "values_finite": all(h["value_loss"] > 0 and math.isfinite(h["value_loss"]) and
                             h["critic_layout"] == "TP2" for h in full),
    }


def _all(root):
    from earl_megatron.runtime.cpu_backend import cpu_backend

    with cpu_backend():
        checkpoints = _checkpoints(root)
    return {"checkpoints": checkpoints, "training": _training(root)}


@pytest.mark.timeout(600)
def test_lora_checkpoints_reshard_and_the_trainer_trains_adapters_only(tmp_path):
    results = run_distributed(_all, 2, str(tmp_path), timeout=500)
    for r in results:
        c, t = r["checkpoints"], r["training"]
        assert c["adapters_nonzero"] and c["differs_before"], c
        assert c["base_entries_same"], c
        assert c["extra"] == (2 * 4 * 4, True), c      # lora_a, lora_b x 4 linears x 4 layers
        assert c["tp2_to_tp1"] and c["tp1_to_tp2"] and c["base_loads_as_full"], c
        assert c["merged_acts_as_adapted"], c
        assert c["critic_merged_on_shards"], c
        assert t["n_adapters"] == 32 and t["base_unchanged"] and t["adapters_changed"], t
        assert t["iterations"] == ([0, 1, 2], [0, 1, 2]), t
        assert t["records_equal"] and t["kl_recorded"] and t["values_finite"], t
    # the trainer's checkpoint (optimizer state beside the model) exports as a PEFT adapter;
    # its run recorded no HF base (run.init unset)
    from safetensors.torch import load_file

    from earl_megatron.weights.convert import convert_mcore_to_hf

    convert_mcore_to_hf(tmp_path / "full" / "checkpoints" / "iter_000002", tmp_path / "peft")
    conf = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["base_model_name_or_path"]) == (4, 8, None)
    assert len(load_file(tmp_path / "peft" / "adapter_model.safetensors")) == 4 * 7 * 2
    # its critic: the base's architecture with a value head, no adapters
    from earl_megatron.weights.critic_export import convert_critic_to_hf

    convert_critic_to_hf(tmp_path / "full" / "checkpoints" / "iter_000002", tmp_path / "critic")
    names = load_file(tmp_path / "critic" / "model.safetensors").keys()
    assert {"score.weight", "score.bias"} <= names and not [n for n in names if "lora" in n]
