"""A critic that starts trained: ``algorithm.critic.init`` from a value model or a PPO run's critic.

    algorithm.critic.init=OUT        an HF value model: what `earl convert mcore-to-hf CKPT OUT
                                     --critic` writes, or any <Family>ForTokenClassification /
                                     ForSequenceClassification of the policy's architecture with
                                     one label (a reward model, as verl and OpenRLHF start
                                     critics from one)
    algorithm.critic.init=runs/RUN/checkpoints/iter_N   a PPO run's trained critic (its
                                     ``critic/``; or that ``critic/`` itself)

``critic_init`` returns, for trainer/critic.build_critic, the init's model config and a ``fill``
hook (models/value_model.critic_loader's) that reads this rank's shard of the trunk and the whole
head into the critic as it is built; None for a policy-shaped init (an HF causal LM or a
converted policy: its trunk, a new head), which build_critic reads itself.

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
from earl_megatron.weights.critic_export import HEAD, find_critic

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
    """(what the init is, the ``fill`` hook) for a value model or a trained critic at ``path``
    (module docstring); None: a policy-shaped init. ``policy``: the policy's model config, whose
    critic the init must be; ``layout``: the critic's."""
    from earl_megatron.models.value_model import critic_config

    arch = value_model_architecture(path)
    if arch is not None:
        return _value_model(Path(path), arch, critic_config(policy), layout)
    found = find_critic(path)
    if found is None:
        return None
    tensors, config_dir, _ = found
    from earl_megatron.weights.convert import load_mcore_into, read_model_config

    with reading(config_dir):
        _same_shape(critic_config(read_model_config(config_dir)), critic_config(policy), path)

    def fill(gpt, coords) -> None:
        with reading(tensors, "critic checkpoint"):
            load_mcore_into(gpt, tensors)

    return f"the trained critic in {tensors}", fill


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


def _same_shape(init: ModelConfig, critic: ModelConfig, path) -> None:
    if init != critic:
        raise ValueError(f"algorithm.critic.init={path} holds another architecture than the "
                         "policy's (model.*): give a value model or critic of the policy's "
                         "shape, or drop it (the policy's initial weights)")


def _value_model(path: Path, arch: str, ccfg: ModelConfig, layout: ParallelLayout
                 ) -> tuple[str, Callable]:
    from earl_megatron.models.value_model import CriticTrunk
    from earl_megatron.plan.tensor_table import OUTPUT
    from earl_megatron.weights.convert import load_hf_into
    from earl_megatron.weights.hf_io import HFCheckpoint

    from earl_megatron.models.value_model import critic_config

    head, bias = HEAD["value_head.weight"], HEAD["value_head.bias"]   # score.weight, .bias
    with reading(path, "value model"):
        ckpt = HFCheckpoint(path)
        causal = next(a for a in VALUE_ARCHITECTURES if arch.endswith(a))
        cfg = hfm.from_hf_config({**ckpt.config,
                                  "architectures": [arch.replace(causal, "ForCausalLM")]})
        _same_shape(critic_config(cfg), ccfg, path)
        if head not in ckpt.files or ckpt.shape(head) != (1, ccfg.hidden_size):
            got = ckpt.shape(head) if head in ckpt.files else "none"
            raise CheckpointError(f"{path}: {arch} with {head} of shape {got}; the critic's "
                                  f"head is one value ({head} [1, {ccfg.hidden_size}]): give a "
                                  "value or reward model with one label")
    lm_head = set(next(r.hf for r in hfm.rules(ccfg) if r.name == OUTPUT))
    trunk = {k: v for k, v in hfm.hf_shapes(ccfg).items() if k not in lm_head}

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
