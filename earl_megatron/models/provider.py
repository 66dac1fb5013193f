"""Megatron-Core GPTModel for the Llama / Qwen2 / Qwen3 / Qwen3-MoE family, built for a layout.

``build_gpt_model(cfg, layout)`` returns Megatron-Core's own ``GPTModel`` for this rank's
pp_stage (pre_process on the first, post_process on the last), with:

- RMSNorm, SwiGLU (gated_linear_unit + silu), rotary embeddings (``rotary_base``), GQA
  (``num_query_groups``), head dim ``kv_channels`` (Qwen3's ``head_dim``, independent of
  hidden / heads), optional qkv bias (Qwen2), optional RMSNorm on every query and key head
  (Qwen3: ``qk_layernorm``, the spec's ``q_layernorm`` / ``k_layernorm``), tied or untied
  embeddings;
- TransformerEngine layer specs when TE is importable and CUDA is present; otherwise Megatron's
  local spec, whose core attention is ``AllGatherKVAttention`` when cp > 1 (Megatron's own
  DotProductAttention refuses CP without TE) and ``InferenceAttention`` at cp = 1 (Megatron's
  DotProductAttention, with fused GQA decode and SDPA prefill in eval mode with a mask:
  inference_attention.py);
- mixture of experts (``cfg.is_moe``): Megatron-Core's MoELayer in every layer: its TopKRouter
  (softmax scores; top-k then softmax over the k, which is Qwen3's renormalised top-k, or
  softmax then top-k when ``moe_norm_topk_prob`` is off; fp32 router logits; Switch aux loss
  with ``moe_aux_loss_coeff``), its all-to-all token dispatcher (dropless: no capacity factor),
  and its experts: TEGroupedMLP (grouped GEMM) with the TE spec, SequentialMLP (one MLP per
  local expert) with the local spec. EP / expert-TP sizes come from the layout. Megatron-Core
  0.16's moe_utils names ``te_general_gemm`` only when TE imports (the router's gating GEMM then
  raises NameError); ``_bind_missing_te_names`` binds the None that megatron.core.extensions
  itself uses without TE, so the router takes its torch.mm path. The CPU-only parts of MoE
  (split sizes kept on the host, the all-to-all backward's buffers) are in runtime/cpu_backend.py.
  With tp > 1 Megatron trains MoE only with sequence parallelism (MoELayer refuses otherwise), so
  an MoE layout with tp > 1 turns it on (``sequence_parallel_for``);
- no dropout, no fused kernels that need CUDA, ``use_cpu_initialization`` on CPU;
- with ``perform_initialization=False`` (weights about to be overwritten: a layout switch, a
  load) parameters are left as ``torch.empty`` and ``set_tensor_parallel_attributes`` marks the
  TP-sharded weights exactly as Megatron's init would have.

``wrap_ddp`` wraps the model in Megatron-Core's DistributedDataParallel (grad buffers, bucketed
all-reduce or reduce-scatter for the distributed optimizer) over the dp x cp group.
Groups must be built (runtime.groups.build_groups) before calling; this module reads no globals
of its own.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.tensor_table import tensor_table

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def te_available() -> bool:
    """TransformerEngine is used only when importable and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def te_layers(cfg: ModelConfig) -> bool:
    """The model's layers are TE's (``layer_spec``): TE is usable and the model has no LoRA
    adapters (TE's qkv linear fuses the input norm, so an adapter beside it would see the
    un-normed input; models/lora.py refuses TE linears). Else Megatron's local layers."""
    return te_available() and not cfg.lora.enabled


def sequence_parallel_for(cfg: ModelConfig, layout: ParallelLayout) -> bool:
    """Whether ``layout`` runs ``cfg`` with sequence parallelism (plan/layout.py: MoE with
    tp > 1, which Megatron's MoELayer requires in training)."""
    return layout.sequence_parallel(cfg)


def _bind_missing_te_names() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_config(cfg: ModelConfig, layout: ParallelLayout, *, pipeline_dtype=None,
                       calculate_per_token_loss: bool = True, recompute: Optional[str] = None,
                       sequence_parallel: Optional[bool] = None,
                       perform_initialization: bool = True, routing_replay: bool = False):
    """Megatron-Core's TransformerConfig for ``cfg`` on ``layout``. ``sequence_parallel``
    None: ``sequence_parallel_for``. ``routing_replay``: MoE routers record and replay their
    top-k choices (Megatron's RouterReplay; models/routing_replay.py drives it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if sequence_parallel is None:
        sequence_parallel = sequence_parallel_for(cfg, layout)

    dtype = _DTYPES[cfg.params_dtype]
    on_cpu = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        sequence_parallel=sequence_parallel and layout.tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=pipeline_dtype or dtype,
        use_cpu_initialization=on_cpu,
        perform_initialization=perform_initialization,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # micro-batches differ in length and rows (length-grouped): pipeline stages exchange
        # each one's shape
        variable_seq_lengths=layout.pp > 1,
        # 0.16 refuses variable_seq_lengths with the default (allgather) MoE token dispatcher
        # even when there are no experts; a dense model never builds a dispatcher
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=calculate_per_token_loss,
        deallocate_pipeline_outputs=False,
        cross_entropy_loss_fusion=False,
    )
    if cfg.is_moe:
        _bind_missing_te_names()
        kwargs.update(
            num_moe_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_router_topk=cfg.moe_router_topk,
            moe_router_score_function="softmax",
            # top-k of the logits then softmax over those k == Qwen3's softmax, top-k, renormalise
            moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_grouped_gemm=te_layers(cfg),
            moe_permute_fusion=False,
            moe_enable_routing_replay=routing_replay,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.expert_tp,
        )
    kwargs.update(recompute_fields(recompute))
    return TransformerConfig(**kwargs)


RECOMPUTE_MODES = ("none", "selective", "full")


def recompute_fields(mode: Optional[str]) -> dict:
    """Megatron-Core's TransformerConfig recompute fields for a mode (plan/specs.Recompute's
    values; None: "none"): full recomputes each layer from its input (uniform, 1 layer a
    checkpoint), selective the core attention only."""
    mode = mode or "none"
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r}: use one of {list(RECOMPUTE_MODES)}")
    full = mode == "full"
    return dict(recompute_granularity=None if mode == "none" else mode,
                recompute_method="uniform" if full else None,
                recompute_num_layers=1 if full else None, recompute_modules=["core_attn"])


def layer_spec(layout: ParallelLayout, cfg: ModelConfig):
    """TE spec when usable, else the local spec (CP attention when cp > 1, InferenceAttention
    otherwise); both with Megatron's own q/k norms when ``cfg.qk_layernorm``. ``te_layers``
    says which (a model with LoRA adapters takes the local spec on GPUs too)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    moe = dict(num_experts=cfg.num_experts, moe_grouped_gemm=te_layers(cfg)) if cfg.is_moe \
        else {}
    if te_layers(cfg):
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm, **moe)
    spec = copy.deepcopy(
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm, **moe))
    if sequence_parallel_for(cfg, layout):   # the final norm: build_gpt_model
        from earl_megatron.models.norms import SequenceParallelRMSNorm
        spec.submodules.input_layernorm = SequenceParallelRMSNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        if cfg.qk_layernorm:   # WrappedTorchNorm refuses any config with sequence_parallel
            attn = spec.submodules.self_attention.submodules
            attn.q_layernorm = attn.k_layernorm = SequenceParallelRMSNorm
    if layout.cp > 1:
        from earl_megatron.models.cp_attention import AllGatherKVAttention as core
    else:  # Megatron's DotProductAttention, fused where the embedded engine decodes
        from earl_megatron.models.inference_attention import InferenceAttention as core
    spec.submodules.self_attention.submodules.core_attention = core
    return spec


def build_gpt_model(cfg: ModelConfig, layout: ParallelLayout, *, pre_process: bool,
                    post_process: bool, config=None, pg_collection=None):
    """One pp_stage of a Megatron-Core GPTModel on the current device."""
    from megatron.core.models.gpt import GPTModel

    tcfg = config or transformer_config(cfg, layout)
    spec = layer_spec(layout, cfg)
    if tcfg.sequence_parallel and not te_layers(cfg):
        # the final norm too: Megatron's block spec would give it WrappedTorchNorm
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from earl_megatron.models.norms import SequenceParallelRMSNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * (cfg.num_layers // layout.pp),
                                          layer_norm=SequenceParallelRMSNorm)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rotary_base),
        pg_collection=pg_collection,
    )
    if not tcfg.perform_initialization:
        set_tensor_parallel_attributes(model, cfg)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def set_tensor_parallel_attributes(model, cfg: ModelConfig) -> None:
    """Mark TP-sharded weights as Megatron's init would have (for ``perform_initialization=False``).

    In megatron-core 0.16 ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``
    are set on a weight only inside the init functions (``_initialize_affine_weight_cpu`` /
    ``_gpu`` in tensor_parallel/layers.py); everything else (``allreduce``, biases, ``shared``,
    ``is_embedding_or_output_parameter``, ``zero_out_wgrad``) is set whatever the flag. Without
    them grad-norm clipping counts every TP shard as a duplicate and Megatron's resharding reads
    the wrong split. The split dim and stride are the tensor table's (plan/tensor_table.py: dim 0
    for the embedding, linear_qkv, linear_fc1 (stride 2) and output layer, dim 1 for linear_proj
    and linear_fc2); a pp_stage's local layer index names a row of the same kind.

    Weights that already carry the attributes are left alone (so this is a no-op after a normal
    init, and biases keep theirs); tests/distributed/test_init_attributes.py checks the result
    equals Megatron's init.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    table = tensor_table(cfg)
    for name, w in model.named_parameters():
        row = table.row(name)
        if row.split_dim is not None and not hasattr(w, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(w, is_parallel=True, dim=row.split_dim,
                                                 stride=row.stride)


def wrap_ddp(model, tcfg, *, use_distributed_optimizer: bool = False,
             bucket_size: Optional[int] = None, pg_collection=None):
    """Megatron-Core DistributedDataParallel over the dp x cp group of the active layout
    (``pg_collection``'s, when given: runtime/groups.current_pg_collection)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
        average_in_collective=False,
    )
    return DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=model,
                                   pg_collection=pg_collection)
