"""Benchmark: the memory model against a GPU's measured peak, term by term (issue 15, item 4).

On one GPU, for a model of ~0.5B parameters built from a config (the Qwen2.5-0.5B shape, bf16,
random weights, no download), with the project's own code (runtime.build.build_on_layout,
runtime.step.train_step, rollout.embedded_engine.EmbeddedEngine):

- TRAIN, per context length: ``torch.cuda.memory_allocated`` after the build (weights), after
  one optimizer step (+ grads + optimizer state, which stay), and
  ``torch.cuda.max_memory_allocated`` during forward + backward (+ activations + logits);
- ROLLOUT, per context length: the static KV cache the engine allocated and the peak during a
  batched ``generate`` (+ decode activations + logits).

Each measured quantity is divided by the memory model's term for the same workload
(plan/memory_model.memory_breakdown with ``DecodeEngine.embedded()``, the engine measured):
ratio 1.00 means the model is exact; the issue asks for a fix where it is off by > 10%.

    python benchmarks/gpu_memory.py                # on a GPU host (torch with CUDA, gloo/nccl)
    python benchmarks/gpu_memory.py --dry-run      # anywhere: the same steps on the tiny model
                                                   # on CPU, sizes and predictions printed,
                                                   # no GPU numbers

Needs torch with CUDA and the project's pure-Python dependencies (megatron-core, which installs
as a wheel; no TransformerEngine or apex: the local layer spec runs). Runs in a few minutes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2 ** 30


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny model: run every step, print sizes, measure nothing")
    ap.add_argument("--train-contexts", default="1024,2048,4096")
    ap.add_argument("--rollout-contexts", default="1024,4096,16384")
    ap.add_argument("--batch", type=int, default=2, help="sequences per TRAIN micro-batch")
    ap.add_argument("--responses", type=int, default=8, help="ROLLOUT prompts per generate")
    ap.add_argument("--new", type=int, default=16, help="tokens generated per prompt")
    return ap.parse_args(argv)


def model_config(dry: bool):
    from earl_megatron.config.model import ModelConfig

    if dry:
        return ModelConfig.tiny("qwen2")
    # Qwen/Qwen2.5-0.5B's shape: 494,032,768 parameters (tied embeddings)
    return ModelConfig(family="qwen2", num_layers=24, hidden_size=896, ffn_hidden_size=4864,
                       num_attention_heads=14, num_query_groups=2, vocab_size=151936,
                       max_position_embeddings=32768, rotary_base=1e6, norm_epsilon=1e-6,
                       add_qkv_bias=True, tie_word_embeddings=True, params_dtype="bfloat16")


def cluster_spec(dry: bool):
    import torch

    from earl_megatron.plan.specs import DecodeEngine
    from earl_megatron.plan.specs import cluster_spec as spec_of

    if dry:
        return spec_of("cpu", nodes=1, devices_per_node=1)
    total = torch.cuda.get_device_properties(0).total_memory
    # the trainer's mapping for one GPU (plan/specs.py), with this device's measured memory;
    # the benchmark decodes with the embedded engine and measures everything it allocates
    return spec_of("h100", nodes=1, devices_per_node=1, device_memory_bytes=total).with_(
        reserved_bytes=0, decode_engine=DecodeEngine.embedded(),
        name=torch.cuda.get_device_name(0))


class Meter:
    """Allocated bytes on the GPU; on CPU (dry run) every reading is None."""

    def __init__(self, gpu: bool):
        import torch

        self.torch, self.gpu = torch, gpu

    def now(self):
        if not self.gpu:
            return None
        self.torch.cuda.synchronize()
        return self.torch.cuda.memory_allocated()

    def reset_peak(self):
        if self.gpu:
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self):
        if not self.gpu:
            return None
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated()


def _ratio(measured, predicted) -> str:
    if measured is None:
        return "   -  "
    return f"{measured / predicted:6.2f}" if predicted else "  n/a "


def _row(stage, ctx, term, predicted, measured) -> None:
    m = "-" if measured is None else f"{measured / GiB:.3f}"
    print(f"{stage:>8} {ctx:>7} {term:>22} {predicted / GiB:>10.3f} {m:>10} "
          f"{_ratio(measured, predicted):>7}")


def train_case(cfg, cluster, ctx: int, batch: int, meter: Meter) -> None:
    import torch

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.memory_model import memory_breakdown
    from earl_megatron.plan.specs import Stage, StageWorkload, TrainOptions
    from earl_megatron.runtime.build import OptimizerSpec, build_on_layout
    from earl_megatron.runtime.step import TokenBatch, local_microbatches, train_step

    lay = ParallelLayout()
    wl = StageWorkload.of(Stage.TRAIN, ctx, batch, micro_batch_tokens=ctx * batch)
    est = memory_breakdown(cfg, lay, wl, TrainOptions(distributed_optimizer=False),
                           cluster=cluster)
    base = meter.now()
    mol = build_on_layout(cfg, lay, optimizer=OptimizerSpec(lr=1e-5))
    weights = meter.now()
    g = torch.Generator().manual_seed(ctx)
    tokens = torch.randint(0, cfg.vocab_size, (batch, ctx + 1), generator=g)
    mbs = local_microbatches(TokenBatch(tokens, torch.ones(batch, ctx + 1)), lay,
                             mol.coords, batch, device=mol_device())
    train_step(mol, mbs, seq_len=ctx, micro_batch_size=batch)   # allocates optimizer state
    state = meter.now()
    meter.reset_peak()
    t0 = time.perf_counter()
    train_step(mol, mbs, seq_len=ctx, micro_batch_size=batch)
    peak, seconds = meter.peak(), time.perf_counter() - t0
    sub = (lambda a, b: None if a is None else a - b)
    _row("train", ctx, "weights", est.weights, sub(weights, base))
    _row("train", ctx, "grads + optimizer", est.grads + est.optimizer, sub(state, weights))
    _row("train", ctx, "activations + logits", est.activations + est.logits, sub(peak, state))
    _row("train", ctx, f"total ({seconds:.2f} s/step)", est.total - est.reserved,
         sub(peak, base))
    del mol, mbs
    _release(meter)


def rollout_case(cfg, cluster, ctx: int, responses: int, new: int, meter: Meter) -> None:
    import torch

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.plan.memory_model import memory_breakdown
    from earl_megatron.plan.specs import Stage, StageWorkload
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.engine import SamplingParams
    from earl_megatron.runtime.build import build_on_layout

    lay = ParallelLayout()
    prompt = ctx - new
    wl = StageWorkload.of(Stage.ROLLOUT, ctx, responses, responses_in_flight=responses,
                          micro_batch_tokens=prompt, decode_fraction=new / ctx)
    est = memory_breakdown(cfg, lay, wl, cluster=cluster)
    base = meter.now()
    mol = build_on_layout(cfg, lay, ddp=False)
    weights = meter.now()
    # prefill one prompt per forward (the unfused attention's scores grow with rows x s^2),
    # as the workload's micro-batch budget says
    engine = EmbeddedEngine(mol, prefill_tokens=prompt)
    g = torch.Generator().manual_seed(ctx)
    prompts = torch.randint(8, cfg.vocab_size, (responses, prompt), generator=g).tolist()
    meter.reset_peak()
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, seed=0))
    peak, seconds = meter.peak(), time.perf_counter() - t0
    kv = engine.kv_cache_bytes()
    sub = (lambda a, b: None if a is None else a - b)
    _row("rollout", ctx, "weights", est.weights, sub(weights, base))
    # the engine's cache is rounded up to 256 slots; the model reserves the context itself
    _row("rollout", ctx, "kv_cache (allocated)", est.kv_cache, kv if meter.gpu else None)
    _row("rollout", ctx, "activations + logits", est.activations + est.logits,
         sub(peak, weights + kv) if meter.gpu else None)
    _row("rollout", ctx, f"total ({seconds:.2f} s/call)", est.total - est.reserved,
         sub(peak, base))
    print(f"{'':>8} {'':>7} {'kv_cache bytes (exact)':>22} model {est.kv_cache:,} engine {kv:,}")
    del engine, mol
    _release(meter)


def mol_device():
    from earl_megatron.runtime import groups

    return groups.device()


def _release(meter: Meter) -> None:
    import gc

    from earl_megatron.runtime import groups

    groups.destroy_groups()
    gc.collect()
    if meter.gpu:
        meter.torch.cuda.empty_cache()


def main(argv=None) -> None:
    args = _args(argv)
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available() and not args.dry_run
    if not gpu and not args.dry_run:
        raise SystemExit("no CUDA device: run on a GPU host, or pass --dry-run")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if gpu:
        torch.cuda.set_device(0)
    from earl_megatron.runtime.dist import world_backend
    dist.init_process_group(world_backend(gpu), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    cfg, cluster = model_config(args.dry_run), cluster_spec(args.dry_run)
    meter = Meter(gpu)
    train_ctx = [int(x) for x in args.train_contexts.split(",")]
    roll_ctx = [int(x) for x in args.rollout_contexts.split(",")]
    if args.dry_run:   # the tiny model on 2 CPU cores: the same steps at 1/16 and 1/32 the length
        train_ctx = [max(32, c // 16) for c in train_ctx]
        roll_ctx = [max(2 * args.new, c // 32) for c in roll_ctx]
    from earl_megatron.plan.tensor_table import num_parameters

    print(f"{cluster.name}: {num_parameters(cfg) / 1e6:.1f}M parameters ({cfg.params_dtype}), "
          f"{'GPU' if gpu else 'DRY RUN on CPU: sizes and predictions only'}")
    print(f"{'stage':>8} {'context':>7} {'term':>22} {'model GiB':>10} {'meas GiB':>10} "
          f"{'ratio':>7}")
    import contextlib

    from earl_megatron.runtime.cpu_backend import cpu_backend
    scope = contextlib.nullcontext() if gpu else cpu_backend()
    t0 = time.perf_counter()
    with scope:
        for ctx in train_ctx:
            train_case(cfg, cluster, ctx, args.batch, meter)
        for ctx in roll_ctx:
            rollout_case(cfg, cluster, ctx, args.responses, args.new, meter)
    print(f"done in {time.perf_counter() - t0:.0f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
