"""A PEFT LoRA adapter as ``run.init``: its base model, with the adapter over it.

The inverse of weights/peft_export.py. A PEFT adapter directory holds ``adapter_config.json``
(``peft_type`` LORA, ``r``, ``lora_alpha``, ``lora_dropout``, ``base_model_name_or_path``) and
``adapter_model.safetensors`` with one (A [r, in], B [out, r]) per HF linear, named
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``. Megatron fuses HF linears
(q/k/v into linear_qkv, gate/up into linear_fc1) and gives each fused linear ONE adapter, so the
modules of a fused set are combined (``fused``):

- their A's are equal (this project's exports): that A, and B's rows per module (zeros for a
  module the adapter leaves out), assembled as the base weight is (weights/hf_mapping
  ``combine``): rank r;
- they differ (PEFT's own init draws each A): A's stacked ``[A_1; ...; A_k]`` and each module's
  B in its own block of columns, the other blocks zero: rank k x r, computing exactly
  ``B_m A_m x`` on module m's rows.

Every linear then gets the largest such rank R (zero rows of A and columns of B pad the others;
a zero pad gets no gradient and stays zero) and alpha is scaled by R / r, so alpha / rank, the
update's scale, is PEFT's. The model computes what ``PeftModel`` computes on the base (tested to
1e-4 on TP2 and PP2). What changes is what training may learn: a fused linear trains its whole
rank-R adapter, the blocks PEFT kept apart included (docs/lora.md, "A PEFT adapter as
run.init"). The KL reference stays the base with the adapters off, as for any LoRA run.

Refused, each in one ValueError naming the key and the fix: another peft_type, DoRA, rsLoRA,
bias, fan_in_fan_out, rank or alpha patterns, layers_to_transform, modules_to_save, a module
that is not one of a decoder layer's attention or MLP linears (experts included), a linear
adapted in some layers only, a base that is not a local model directory, ``.bin`` weights.

Pure except what reads files (``read_adapter``, ``adapter_tensors``, ``recorded_base``; the
base's config through the caller's reader, so nothing here imports weights/convert.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from earl_megatron.config.lora import TARGETS, LoraSpec
from earl_megatron.config.model import ModelConfig
from earl_megatron.runtime.checkpoint import CONFIG_JSON
from earl_megatron.weights import hf_mapping as hfm
from earl_megatron.weights.peft_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX,
                                               adapted_linears)

_PLAIN = {"use_dora": (None, False), "use_rslora": (None, False), "bias": (None, "none"),
          "fan_in_fan_out": (None, False), "rank_pattern": (None, {}),
          "alpha_pattern": (None, {}), "layers_to_transform": (None, []),
          "modules_to_save": (None, [])}
"""adapter_config.json keys whose other values change what the adapter computes or trains."""


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter directory: ``path``, its ``base`` model directory, r, alpha, dropout."""

    path: Path
    base: Path
    r: int
    alpha: float
    dropout: float


def is_peft_adapter(path) -> bool:
    """A PEFT adapter directory (adapter_config.json, no model config.json beside it)."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def read_adapter(path) -> PeftAdapter:
    """The adapter's config, checked (module docstring: what is refused)."""
    p = Path(path)
    try:
        conf: dict[str, Any] = json.loads((p / ADAPTER_CONFIG).read_text())
    except ValueError as e:
        raise ValueError(f"{p / ADAPTER_CONFIG} is not valid JSON ({e}); save the adapter "
                         "again (PeftModel.save_pretrained)") from None
    if conf.get("peft_type") != "LORA":
        raise ValueError(f"{p} is a PEFT {conf.get('peft_type')} adapter: only LoRA adapters "
                         "(peft_type LORA) start a run; merge it into its base with peft and "
                         "pass that directory")
    odd = {k: conf[k] for k, plain in _PLAIN.items() if k in conf and conf[k] not in plain}
    if odd:
        raise ValueError(f"{p}: adapter_config.json sets {odd}, which LoRA on Megatron-Core does "
                         "not compute; merge the adapter into its base with peft "
                         "(merge_and_unload, save_pretrained) and pass that directory")
    base = conf.get("base_model_name_or_path")
    if not base or not (Path(str(base)).expanduser() / "config.json").is_file():
        raise ValueError(f"{p}: base_model_name_or_path={base!r} is not a local model directory "
                         "(nothing is downloaded): set it in adapter_config.json to the directory "
                         "of the model the adapter was trained on")
    if not (p / ADAPTER_WEIGHTS).is_file():
        found = sorted(f.name for f in p.glob("adapter_model*"))
        raise ValueError(f"{p} has no {ADAPTER_WEIGHTS} (found {found or 'nothing'}): save the "
                         "adapter with safetensors (save_pretrained's default "
                         "safe_serialization=True)")
    r, alpha = conf.get("r"), conf.get("lora_alpha", 8)
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{p}: r={r!r}, lora_alpha={alpha!r}; both must be positive numbers")
    return PeftAdapter(p, Path(str(base)).expanduser(), r, float(alpha),
                       float(conf.get("lora_dropout") or 0.0))


def adapter_tensors(adapter: PeftAdapter) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(adapter.path / ADAPTER_WEIGHTS))


def fused(adapter: PeftAdapter, cfg: ModelConfig, tensors: dict[str, torch.Tensor]
          ) -> tuple[LoraSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """``model.lora`` for the adapter on ``cfg`` (the base's config) and the FULL fp32 (A, B)
    of every adapted Megatron linear by its name (``decoder.layers.<i>.<path>``, as
    models/lora.py ``LoraLinear.name``)."""
    # every linear an adapter may target on this model (an MoE's MLP linears are its experts',
    # which ModelConfig refuses: their adapters come out as tensors of no known module)
    allowed = tuple(t for t in TARGETS if not (cfg.is_moe and t in ("linear_fc1", "linear_fc2")))
    every = adapted_linears(cfg.with_(lora=LoraSpec(rank=1, targets=allowed)))
    shapes = hfm.hf_shapes(cfg)
    known: set[str] = set()
    blocks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    kinds: dict[str, set[int]] = {}
    for lin in every:
        modules = [PEFT_PREFIX + n[:-len(".weight")] for n in lin.base.hf]
        known.update(m + s for m in modules for s in (".lora_A.weight", ".lora_B.weight"))
        found = [m for m in modules if m + ".lora_A.weight" in tensors]
        if not found:
            continue
        name = lin.base.name[:-len(".weight")]
        kinds.setdefault(name.rsplit(".", 1)[1], set()).add(lin.base.layer)
        a_s = [tensors[m + ".lora_A.weight"].float() for m in found]
        shared = all(torch.equal(a_s[0], a) for a in a_s[1:])
        a = a_s[0] if shared else torch.cat(a_s)
        parts = []
        for m, hf in zip(modules, lin.base.hf):
            b = torch.zeros(shapes[hf][0], a.shape[0])
            if m in found:
                j = 0 if shared else found.index(m) * adapter.r
                b[:, j:j + adapter.r] = tensors[m + ".lora_B.weight"].float()
            parts.append(b)
        blocks[name] = (a, hfm.combine(lin.base, cfg, parts))
    extra = sorted(set(tensors) - known)
    if extra:
        raise ValueError(f"{adapter.path}: {len(extra)} tensors adapt modules LoRA on this model "
                         f"cannot (e.g. {extra[0]}): adapters go on the decoder layers' "
                         "attention and MLP linears (q/k/v/o, gate/up/down), experts excepted")
    if not blocks:
        raise ValueError(f"{adapter.path}: {ADAPTER_WEIGHTS} holds no LoRA tensor")
    layers = {lin.base.layer for lin in every}
    partial = sorted(k for k, held in kinds.items() if held != layers)
    if partial:
        raise ValueError(f"{adapter.path} adapts {partial} in some layers only: LoRA here "
                         "adapts a linear in every layer; merge the adapter into its base with "
                         "peft and pass that directory")
    rank = max(a.shape[0] for a, _ in blocks.values())
    padded = {n: (torch.cat([a, torch.zeros(rank - a.shape[0], a.shape[1])]),
                  torch.cat([b, torch.zeros(b.shape[0], rank - b.shape[1])], dim=1))
              for n, (a, b) in blocks.items()}
    spec = LoraSpec(rank=rank, alpha=adapter.alpha * rank / adapter.r, dropout=adapter.dropout,
                    targets=tuple(t for t in TARGETS if t in kinds))
    return spec, padded


def adapter_spec(path, read_config: Callable[[Path], ModelConfig]
                 ) -> tuple[PeftAdapter, LoraSpec]:
    """The adapter at ``path`` and the ``model.lora`` it gives its base, whose config
    ``read_config`` reads (weights/convert.py ``read_model_config``: this module stays below
    it). Files read."""
    adapter = read_adapter(path)
    spec, _ = fused(adapter, read_config(adapter.base), adapter_tensors(adapter))
    return adapter, spec


def for_policy(path, lora: Optional[LoraSpec], read_config: Callable[[Path], ModelConfig]
               ) -> tuple[Path, LoraSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """``load_policy``'s view of the adapter at ``path``: (its base, the ``model.lora`` spec,
    the FULL (A, B) by linear). ``lora``: the run's ``model.lora`` (apply_run_init set it from
    the adapter); None or rank 0 takes the adapter's, any other spec that differs is refused."""
    from earl_megatron.runtime.io_errors import CheckpointError

    try:
        adapter = read_adapter(path)
        spec, full = fused(adapter, read_config(adapter.base), adapter_tensors(adapter))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if lora is not None and lora.enabled and lora != spec:
        raise CheckpointError(f"model.lora={lora} differs from what the PEFT adapter {path} "
                              f"gives its base ({spec}): drop model.lora.* to take the adapter's")
    return adapter.base, spec, full


def model_dir(init: Optional[str]) -> Optional[str]:
    """The model directory ``run.init`` stands for: a PEFT adapter's base, else itself."""
    return str(read_adapter(init).base) if init and is_peft_adapter(init) else init


def recorded_base(ckpt: Path) -> Optional[str]:
    """The HF model a training checkpoint's run started from (the PEFT export's
    ``base_model_name_or_path``): ``run.init`` in the run's ``resolved.json`` (the checkpoint is
    ``RUN/checkpoints/iter_N``; a PEFT adapter's base), unless that names a Megatron checkpoint
    (which PEFT cannot load a base from). None when nothing is recorded."""
    resolved = Path(ckpt).parent.parent / "resolved.json"
    try:
        init = json.loads(resolved.read_text()).get("run", {}).get("init")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(init, str) or not init or (Path(init) / CONFIG_JSON).is_file():
        return None
    return model_dir(init)
