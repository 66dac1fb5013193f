"""PPO's critic: Megatron-Core's own GPTModel with a scalar value head in place of the output layer.

The critic is the policy's architecture (``critic_config``: the same ModelConfig, untied, no
adapters) built by ``runtime/build.build_on_layout`` like any model, whose ``load`` hook is
``critic_loader``: it fills the trunk (embedding, layers, final norm) with this rank's shard of
the policy's full weights through ``models/sharding.load_full_weights`` (the path
``build_on_layout(weights=)`` takes) and puts a ``ValueHead`` where GPTModel's
``output_layer`` was, on the last pp_stage, before DDP wraps the model. So Megatron's pipeline
schedules, DDP (grad buffers over dp x cp), optimizers and dist_checkpointing run the critic
unchanged::

    build_on_layout(critic_config(cfg), layout, load=critic_loader(weights, cfg, layout))

GPTModel's last pp_stage then returns ``[b, s, 1]`` for ``model(input_ids, position_ids,
None)`` (never pass ``labels``: GPTModel would take a cross-entropy of the values);
runtime/step.py runs it: ``forward_values`` (a VALUES stage's forward, ``forward_logprobs``'
twin) and ``forward_backward_values`` (a per-token value loss's gradients, a CRITIC TRAIN
stage's). They live there, not here, because they share the schedule code of the policy's
paths (and models/ may not import runtime/).
``V[b, t]`` is the value of the context up to and including token t (rl/value.py's alignment:
position t is the state in which the policy picks token t + 1).

Invariants and choices:

- The head is an ``nn.Linear(hidden, 1)`` replicated over tp: after the final norm the hidden
  state is replicated over tp, so every tp rank computes the same values and the same head
  gradient, and the trunk's gradient needs no tp all-reduce (each tp rank's is already whole,
  where the vocab-parallel output layer's are partial sums). Under sequence parallelism (MoE
  with tp > 1) the hidden state is sequence-sharded: the head all-gathers it over tp first, and
  its backward keeps this rank's slice of the (replicated) gradient instead of reduce-scattering.
- Initialisation: the trunk bit-exact from the policy's weights; the head's weight drawn
  normal with standard deviation 1 / (hidden + 1) from its own generator seeded by ``seed``
  (OpenRLHF's value-head init: small, so the first values are near 0, but not zero, so the
  trunk gets gradients from the first step), its bias 0. Every rank draws the same full head,
  whatever the layout.
- The head computes in fp32 (its parameters stay in the model's dtype for DDP and Megatron's
  mixed-precision optimizer): values are regression targets, read as fp32.
- dist_checkpointing: the head saves as ``value_head.weight`` / ``value_head.bias``, replicated
  over tp and dp x cp, so a critic checkpoint loads on any layout (the trunk's keys are the
  policy's), and loading a policy checkpoint into a critic fails on the missing head instead of
  reading the vocabulary matrix's first row.
- The critic is built untied: with tied embeddings Megatron keeps a copy of the word embedding
  in the last pp_stage's output layer and all-reduces its gradient with the first stage's; the
  critic has no output layer to tie. A policy with LoRA adapters gives a critic without them
  (the critic trains every parameter).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch

from earl_megatron.config.model import ModelConfig
from earl_megatron.models.sharding import load_full_weights, unwrap
from earl_megatron.plan.layout import Coords, ParallelLayout

HEAD_KEY = "value_head."
"""dist_checkpointing's key prefix of the head's tensors (the module sits at ``output_layer``)."""


def critic_config(cfg: ModelConfig) -> ModelConfig:
    """The critic's ModelConfig for a policy's: the same trunk, untied, without adapters, with
    the value head (``value_head``: the tensor table knows its rows, build_on_layout installs
    it, so the switcher moves the critic like any model). Idempotent."""
    return replace(cfg.base, tie_word_embeddings=False, value_head=True)


def install_head(model: torch.nn.Module, seed: int) -> None:
    """Put a ``ValueHead`` (drawn from ``seed``) where the bare GPTModel ``model``'s output layer
    is, on the last pp_stage; build_on_layout calls it for a ``value_head`` config, before
    anything loads and before DDP wraps the model."""
    gpt = unwrap(model)
    if not gpt.post_process:
        return
    tcfg = gpt.config
    gpt.output_layer = ValueHead(tcfg.hidden_size, dtype=tcfg.params_dtype, seed=seed,
                                 tp_group=gpt.tp_group, sequence_parallel=tcfg.sequence_parallel)
    if torch.cuda.is_available():
        gpt.output_layer.cuda(torch.cuda.current_device())


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] (sequence-sharded [s/tp, b, h] under SP) -> values [s, b, 1] in fp32.

    Called where GPTModel calls its output layer (``weight=`` and ``runtime_gather_output=``
    are that call's and ignored) and returns its ``(output, bias)`` pair."""

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, seed: int, tp_group,
                 sequence_parallel: bool):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(1, hidden_size, generator=g) / (hidden_size + 1)
        self.weight = torch.nn.Parameter(w.to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every tp rank computes the whole sequence's values: the backward keeps this
            # rank's slice of an identical gradient (no reduce-scatter, which would sum tp
            # copies)
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group)
        values = torch.nn.functional.linear(hidden.float(), self.weight.float(), self.bias.float())
        return values, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """Megatron's sharded state dict: both tensors whole, replicated over tp and dp x cp,
        under ``HEAD_KEY`` (module docstring); the dict keys are the module's own."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
        from megatron.core.utils import make_sharded_tensor_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return {f"{prefix}{name}": make_sharded_tensor_for_checkpoint(
                    p, f"{HEAD_KEY}{name}", prepend_offsets=sharded_offsets,
                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
                for name, p in self.named_parameters()}


class CriticTrunk:
    """The critic's parameters but the head's, named as the policy's (what the tensor table
    knows): pass it where ``models/sharding.load_full_weights`` or ``weights/gather.gather_full``
    take a model, to load or gather the trunk."""

    def __init__(self, model):
        self._model = unwrap(model)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self._model.named_parameters()
                if not n.startswith("output_layer."))


def value_head(model) -> Optional[ValueHead]:
    """The critic's head on this rank (None on pp_stages other than the last)."""
    head = getattr(unwrap(model), "output_layer", None)
    return head if isinstance(head, ValueHead) else None


def critic_loader(weights: Optional[dict[str, torch.Tensor]], cfg: ModelConfig,
                  layout: ParallelLayout, *,
                  fill: Optional[Callable[[torch.nn.Module, Coords], None]] = None
                  ) -> Callable[[torch.nn.Module, Coords], None]:
    """``build_on_layout``'s ``load`` hook for the critic (built from ``critic_config``, so its
    head is in place, drawn from the build's seed): the trunk from the policy's full
    ``weights`` (tied or not: the output layer is never read). ``cfg``: the critic's or the
    policy's. ``fill``: a critic read from elsewhere instead (a value model, a trained critic:
    weights/critic_import.py; the policy's shards: trainer/critic.copied_from), called with the
    bare GPTModel; it overwrites the trunk, and the head or not (``weights`` unused)."""
    ccfg = critic_config(cfg)

    def load(model: torch.nn.Module, coords: Coords) -> None:
        gpt = unwrap(model)
        if gpt.post_process and not isinstance(gpt.output_layer, ValueHead):
            raise ValueError("the critic must be built with its head: build_on_layout("
                             "critic_config(cfg), ...), not the policy's config")
        if fill is None:
            load_full_weights(CriticTrunk(gpt), weights, ccfg, layout, coords)
        else:
            fill(gpt, coords)

    return load


def critic_values(output: torch.Tensor) -> torch.Tensor:
    """GPTModel's critic output [b, s, 1] -> the values, fp32 [b, s] (runtime/step.py's
    ``forward_values`` and ``forward_backward_values`` read it so)."""
    return output[..., 0].float()
