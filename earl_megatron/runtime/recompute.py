"""Activation recomputation of a live Megatron-Core model, switched without a rebuild.

The selector chooses a recompute mode per TRAIN stage (plan/selector.py); ``set_recompute``
puts it into effect on the model the TRAIN stage runs. Megatron-Core 0.16 reads the modes at
forward time, so a change costs nothing (no rebuild, no weights moved):

- full: ``TransformerBlock.forward`` tests ``config.recompute_granularity == "full"`` (and
  ``self.training``) at every call, and ``_checkpointed_forward`` reads ``recompute_method`` /
  ``recompute_num_layers`` there: writing the config's fields is the switch.
- selective (``recompute_modules=["core_attn"]``): each ``Attention`` (and the
  ``TransformerBlock``) derives ``checkpoint_core_attention`` from the config in its
  constructor and tests that flag at every forward; ``set_recompute`` re-derives it with the
  constructor's own expression. The other selective modules (layernorm, mlp, moe) are never
  enabled here, so their construction-time flags stay False.

Every module of a GPTModel holds the same TransformerConfig object; the fields are written on
each distinct config found in the model, so a config shared with a second model (a live copy
built from ``ModelOnLayout.tcfg``) changes with it: the switch is for the model whose config it
is. Equal loss and gradients in every mode, and the bytes saved for backward per mode, are
checked in tests/distributed/test_recompute.py.
"""

from __future__ import annotations

from earl_megatron.models.provider import recompute_fields


def set_recompute(on_layout, mode: str) -> None:
    """Run ``on_layout``'s model (a ModelOnLayout) with recompute ``mode`` from its next
    forward: "none", "selective" or "full"."""
    fields = recompute_fields(mode)
    configs = {id(on_layout.tcfg): on_layout.tcfg}
    modules = list(on_layout.module().modules())
    for m in modules:
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "recompute_granularity"):
            configs[id(cfg)] = cfg
    for cfg in configs.values():
        for name, value in fields.items():
            setattr(cfg, name, list(value) if isinstance(value, list) else value)
    for m in modules:
        if hasattr(m, "checkpoint_core_attention"):
            m.checkpoint_core_attention = (m.config.recompute_granularity == "selective"
                                           and "core_attn" in m.config.recompute_modules)


def recompute_of(on_layout) -> str:
    """The mode ``on_layout``'s model runs with now."""
    return on_layout.tcfg.recompute_granularity or "none"
