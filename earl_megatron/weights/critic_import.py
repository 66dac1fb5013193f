"""A critic that starts trained: ``algorithm.critic.init`` from a value model or a PPO run's critic.

    algorithm.critic.init=OUT        an HF value model: what `earl convert mcore-to-hf CKPT OUT
                                     --critic` writes, or any <Family>ForTokenClassification /
                                     ForSequenceClassification of the policy's architecture with
                                     one label (a reward model, as verl and OpenRLHF start
                                     critics from one)
    algorithm.critic.init=runs/RUN/checkpoints/iter_N   a PPO run's trained critic (its
                                     ``critic/``; or that ``critic/`` itself)

    algorithm.critic.init=HF_DIR | CONVERTED   a policy-shaped model: its trunk, a new head

``critic_init`` returns, for trainer/critic.build_critic, what the init is and a ``fill`` hook
(models/value_model.critic_loader's) that reads this rank's shard of the trunk (and of a value
model or trained critic, the whole head) into the critic as it is built, in the critic's own
layout: no rank gathers the whole model. None for anything else (a PEFT adapter, which
build_critic loads as a policy in the critic's layout and merges on each shard; a LoRA
checkpoint or a path that holds no model, which that load refuses in one line).

Invariants: an HF value model is read shard by shard (weights/convert.load_hf_into's reads, no
rank holds the whole model); its ``score.weight`` [1, hidden] is the head's weight and
``score.bias`` its bias, 0 where the file has none (a sequence-classification reward model's
score has no bias). A critic checkpoint is read by dist_checkpointing into the critic's own
sharded state, any layout, head included: a collective, which a rank that holds no critic (the
split placement's rollout pool) joins with ``join_critic_init``. Either way the architecture
must be the policy's critic (``critic_config`` equal), else one line naming the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.io_errors import CheckpointError, reading
from earl_megatron.weights import hf_mapping as hfm
from earl_megatron.weights.critic_export import HEAD, find_critic, trunk_rules

VALUE_ARCHITECTURES = ("ForTokenClassification", "ForSequenceClassification")
"""transformers' heads whose ``score`` is a Linear over the final norm's output."""


def value_model_architecture(path: str | Path) -> Optional[str]:
    """The architecture of an HF value model directory (config.json's first, ending in one of
    VALUE_ARCHITECTURES), or None for anything else."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    with reading(config, "HF config"):
        archs = json.loads(config.read_text()).get("architectures") or []
    return archs[0] if archs and archs[0].endswith(VALUE_ARCHITECTURES) else None


def critic_init(path: str | Path, policy: ModelConfig, layout: ParallelLayout
                ) -> Optional[tuple[str, Callable]]:
    """(what the init is, the ``fill`` hook) for the init at ``path`` (module docstring); None:
    one build_critic loads as a policy. ``policy``: the policy's model config, whose critic the
    init must be; ``layout``: the critic's."""
    from earl_megatron.models.value_model import critic_config

    arch = value_model_architecture(path)
    if arch is not None:
        return _value_model(Path(path), arch, critic_config(policy), layout)
    found = find_critic(path)
    if found is None:
        return _policy_shaped(Path(path), critic_config(policy), layout)
    tensors, config_dir, _ = found
    from earl_megatron.weights.convert import load_mcore_into, read_model_config

    with reading(config_dir):
        same_shape(critic_config(read_model_config(config_dir)), critic_config(policy), path)

    def fill(gpt, coords) -> None:
        with reading(tensors, "critic checkpoint"):
            load_mcore_into(gpt, tensors)

    return f"the trained critic in {tensors}", fill


def _policy_shaped(path: Path, ccfg: ModelConfig, layout: ParallelLayout
                   ) -> Optional[tuple[str, Callable]]:
    """An HF causal LM or a converted policy read straight into the critic's trunk in its own
    layout (its head stays the seeded one); None where build_critic loads it as a policy
    instead: a PEFT adapter (the base with its adapter), a LoRA checkpoint or no model at all
    (load_policy's refusals name them)."""
    from earl_megatron.models.value_model import CriticTrunk, critic_config
    from earl_megatron.weights.convert import (is_mcore_checkpoint, load_hf_into,
                                               load_mcore_into, read_model_config)
    from earl_megatron.weights.hf_io import HFCheckpoint
    from earl_megatron.weights.peft_import import is_peft_adapter

    if is_peft_adapter(path) or not (is_mcore_checkpoint(path) or (path / "config.json").is_file()):
        return None
    with reading(path):
        cfg = read_model_config(path)
    if cfg.lora.enabled:
        return None
    same_shape(critic_config(cfg), ccfg, path)
    if is_mcore_checkpoint(path):
        def fill(gpt, coords) -> None:   # the trunk alone: the seeded head stays
            with reading(path, "policy checkpoint"):
                load_mcore_into(gpt, path, skip=("output_layer.",))

        return f"the trunk of the converted policy {path}", fill
    with reading(path, "HF model"):
        ckpt = HFCheckpoint(path)
    trunk = _trunk_shapes(ccfg)

    def fill(gpt, coords) -> None:
        with reading(path, "HF model"):
            load_hf_into(CriticTrunk(gpt), ckpt, ccfg, layout, coords, expected=trunk)

    return f"the trunk of the HF model {path}", fill


def join_critic_init(path: str | Path) -> bool:
    """A rank that builds no critic joins the collective read of a trained critic's ``fill``
    (a value model is read per rank: nothing to join). False: ``path`` is a policy-shaped init,
    whose read the caller joins (weights/convert.join_policy_load)."""
    from megatron.core import dist_checkpointing

    if value_model_architecture(path):
        return True
    found = find_critic(path)
    if found is None:
        return False
    with reading(found[0], "critic checkpoint"):
        dist_checkpointing.load({}, str(found[0]))
    return True


def same_shape(init: ModelConfig, critic: ModelConfig, path) -> None:
    """``init`` (a critic.init's critic config) must be ``critic``, the policy's; else one
    line naming the fix."""
    if init != critic:
        raise ValueError(f"algorithm.critic.init={path} holds another architecture than the "
                         "policy's (model.*): give a value model or critic of the policy's "
                         "shape, or drop it (the policy's initial weights)")


def _value_model(path: Path, arch: str, ccfg: ModelConfig, layout: ParallelLayout
                 ) -> tuple[str, Callable]:
    from earl_megatron.models.value_model import CriticTrunk, critic_config
    from earl_megatron.weights.convert import load_hf_into
    from earl_megatron.weights.hf_io import HFCheckpoint

    head, bias = HEAD["value_head.weight"], HEAD["value_head.bias"]   # score.weight, .bias
    with reading(path, "value model"):
        ckpt = HFCheckpoint(path)
        causal = next(a for a in VALUE_ARCHITECTURES if arch.endswith(a))
        cfg = hfm.from_hf_config({**ckpt.config,
                                  "architectures": [arch.replace(causal, "ForCausalLM")]})
        same_shape(critic_config(cfg), ccfg, path)
        if head not in ckpt.files or ckpt.shape(head) != (1, ccfg.hidden_size):
            got = ckpt.shape(head) if head in ckpt.files else "none"
            raise CheckpointError(f"{path}: {arch} with {head} of shape {got}; the critic's "
                                  f"head is one value ({head} [1, {ccfg.hidden_size}]): give a "
                                  "value or reward model with one label")
    trunk = _trunk_shapes(ccfg)

    def fill(gpt, coords) -> None:
        with reading(path, "value model"):
            load_hf_into(CriticTrunk(gpt), ckpt, ccfg, layout, coords, expected=trunk)
            if gpt.post_process:
                out = gpt.output_layer
                w = ckpt.read(head)
                b = ckpt.read(bias) if bias in ckpt.files else torch.zeros(1)
                with torch.no_grad():
                    out.weight.copy_(w.reshape(out.weight.shape).to(out.weight.dtype))
                    out.bias.copy_(b.reshape(out.bias.shape).to(out.bias.dtype))

    return f"the value model {path} ({arch})", fill


def _trunk_shapes(ccfg: ModelConfig) -> dict:
    """The HF tensors (name: shape) of the critic's trunk: all of the model's but the head."""
    trunk = {n for r in trunk_rules(ccfg) for n in r.hf}
    return {k: v for k, v in hfm.hf_shapes(ccfg).items() if k in trunk}
