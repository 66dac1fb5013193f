"""Benchmark: rollout engines against each other, KV cache vs recompute-all, and Connect Four.

0. Engines (issue 15). The same tiny Qwen2 (3 layers, hidden 96, 6 heads, 2 KV groups, fp32),
   one thread, T=1 sampling, ``--engine-cases`` (default 16 prompts x 64 tokens, 32 new; 64 x
   256, 128 new): tokens/s (generated tokens / wall time of one batched call, prefill included,
   median of ``--reps`` interleaved repetitions) of the transformers reference engine (HFEngine,
   outside the CPU backend, which it does not need) and the embedded Megatron-Core engine (TP1);
   then, when the SGLang venv exists (``--sglang-venv``, built by ``make sglang``), real SGLang
   CPU servers in ``--sglang-layouts`` (tp1, tp2, dp2; radix caches flushed before every
   repetition, or repeated prompts would be answered from cache; benchmarks/sglang_bench.py).
   Ratios embedded / HF (wall, and per CPU-second of the process, which other load on a noisy
   host does not move) and embedded / SGLang tp1; target >= 1.0. Weight sync: the full state
   dict of ``--sync-model`` pushed into one server with update_weights_from_distributed (gloo,
   the trainer's path) vs written to disk and loaded with update_weights_from_disk: seconds,
   bytes and the ratio.
1. Decode throughput. For each rollout layout (default TP1 on 1 rank and TP2 on 2 ranks) and
   context (default 512 and 2,048 tokens): a batch of prompts of ``context - new`` tokens, then
   ``new`` greedy tokens, (a) with Megatron's StaticInferenceContext (one prefill, then one token
   per forward) and (b) recomputing the whole sequence every step (the same engine with
   ``kv_cache=False``). Tokens/s = generated tokens / wall time of ``generate`` (prefill
   included), median of ``--reps``; both must emit the same tokens.
2. Episodes/s on Connect Four (random opponent) through ``run_episodes``, both modes, one rank.
   A random-init model emits garbage and every game would end at its first, unparsable move, so
   the weights are edited into a *digit policy*: residual dim 0 carries a constant through every
   layer and the output layer reads only that dim, so '0'-'6' share almost all the probability
   whatever the context (as in tests/unit/test_agent_loop.py). Every turn samples
   ``--action-tokens`` digits (the first one is the move); games run to a result or an illegal
   move (a full column), contexts grow with the move history, and the engine does real work at
   realistic lengths. Three modes: "kv+reuse" keeps each episode's cache between turns and
   prefills only the new observation (``reuse_prefix=True``); "kv_cache" re-prefills the whole
   context every turn, so it saves at most (action tokens - 1) of the full forwards of a turn;
   "recompute" runs a full forward per token. All three must build the same episodes.

    python benchmarks/rollout.py [--contexts 512,2048] [--new 32] [--batch 2] [--reps 3]
                                 [--layouts tp1,tp2 | none] [--episodes 16] [--action-tokens 4]

Targets: KV cache >= 5x recompute-all at 2,048 tokens (issue 7); embedded >= 1.0x HF generate
and >= 1.0x SGLang's CPU server (issue 15).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from earl_megatron.testing.multiproc import run_distributed

DIGIT_LOGIT = 5.0


def digit_policy_weights(cfg, tokenizer, seed: int = 3):
    """Reference weights whose samples are digits 0-6 (see the module docstring)."""
    from earl_megatron.testing.weights import biased_weights

    return biased_weights(cfg, {tokenizer.convert_tokens_to_ids(str(c)): DIGIT_LOGIT
                                for c in range(7)}, seed=seed)


ENGINE_MODEL = dict(family="qwen2", num_layers=3, hidden_size=96, ffn_hidden_size=256,
                    num_attention_heads=6, num_query_groups=2)
SYNC_MODEL = dict(family="qwen2", num_layers=8, hidden_size=512, ffn_hidden_size=1536,
                  num_attention_heads=8, num_query_groups=2, vocab_size=4096)


def _engines_bench(hf_dir, cases, reps):
    import torch
    from transformers import AutoModelForCausalLM

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.engine import SamplingParams
    from earl_megatron.testing.hf_engine import HFEngine
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.hf_mapping import to_megatron

    cfg = ModelConfig.tiny(**ENGINE_MODEL)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf = HFEngine(hf_model)
    backend = cpu_backend()  # one scope for the whole run: entering it resets the RNG tracker
    backend.__enter__()
    mol = build_on_layout(cfg, ParallelLayout(), ddp=False,
                          weights=to_megatron(cfg, hf_model.state_dict()))
    embedded = EmbeddedEngine(mol)
    run_embedded = embedded.generate

    def run_hf(prompts, params):
        # transformers needs no CUDA redirection: it runs without the backend's torch-function
        # mode, as it would in a process of its own
        with torch._C.DisableTorchFunction():
            return hf.generate(prompts, params)

    rows = []
    g = torch.Generator().manual_seed(0)
    for batch, plen, new in cases:
        prompts = torch.randint(8, cfg.vocab_size, (batch, plen), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_new_tokens=new)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=new)
        same = ([o.token_ids for o in run_embedded(prompts, greedy)]
                == [o.token_ids for o in run_hf(prompts, greedy)])  # also the warm-up
        walls = {"hf": [], "embedded": []}
        for _ in range(reps):  # interleaved: every engine sees the same background load
            for name, fn in (("hf", run_hf), ("embedded", run_embedded)):
                t0, c0 = time.perf_counter(), time.process_time()
                out = fn(prompts, params)
                walls[name].append((sum(len(o.token_ids) for o in out),
                                    time.perf_counter() - t0, time.process_time() - c0))
        row = {"case": f"{batch} x {plen}, {new} new", "greedy_same": same}
        for name, w in walls.items():
            row[name] = w[0][0] / statistics.median(s for _, s, _ in w)
            row[name + "_cpu"] = w[0][0] / statistics.median(c for _, _, c in w)
        rows.append(row)
    groups.destroy_groups()
    backend.__exit__(None, None, None)
    return rows


def _hf_dir(out: str, model: dict, seed: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.sharding import reference_weights
    from earl_megatron.weights.hf_mapping import to_hf, to_hf_config

    cfg = ModelConfig.tiny(**model)
    hc = {k: v for k, v in to_hf_config(cfg).items() if k != "architectures"}
    hf = Qwen2ForCausalLM(Qwen2Config(**hc)).float()
    hf.load_state_dict(to_hf(cfg, reference_weights(cfg, seed=seed)), strict=False)
    hf.save_pretrained(out)


def engines_section(args) -> None:
    from benchmarks.sglang_bench import layout_rates, weight_sync

    cases = [tuple(int(x) for x in c.split("x")) for c in args.engine_cases.split(",")]
    venv = Path(args.sglang_venv).expanduser() if args.sglang_venv else None
    python = str(venv / "bin" / "python") if venv else ""
    if venv and not Path(python).is_file():
        print(f"no SGLang venv at {venv} (`make sglang` builds it): SGLang columns skipped")
        python = ""
    layouts = [x for x in args.sglang_layouts.split(",") if x] if python else []
    with tempfile.TemporaryDirectory() as tmp:
        _hf_dir(tmp, ENGINE_MODEL, seed=7)
        rows = run_distributed(_engines_bench, 1, tmp, cases, args.reps, timeout=1800)[0]
        sglang = layout_rates(python, tmp, cases, args.reps, layouts) if layouts else {}
    print("engines: tiny Qwen2 (3 layers, hidden 96), one thread per rank, T=1, tokens/s "
          f"(wall, median of {args.reps} reps, prefill included)")
    heads = "".join(f" {'SGLang ' + n:>11}" for n in sglang)
    print(f"{'case':>22} {'HF':>8} {'embedded':>9}{heads} {'emb/HF':>7} {'cpu':>6} "
          f"{'emb/SGL tp1':>11} {'greedy emb == HF':>17}")
    for i, r in enumerate(rows):
        emb = r["embedded"]
        cols = "".join(f" {v[i]:>11.0f}" for v in sglang.values())
        tp1 = f"{emb / sglang['tp1'][i]:.2f}x" if "tp1" in sglang else "-"
        print(f"{r['case']:>22} {r['hf']:>8.0f} {emb:>9.0f}{cols} {emb / r['hf']:>6.2f}x "
              f"{r['embedded_cpu'] / r['hf_cpu']:>5.2f}x {tp1:>11} {str(r['greedy_same']):>17}")
    print("  emb/HF: wall tokens/s ratio; cpu: the same per CPU-second of the benchmark process "
          "(both engines run in it, one thread: robust to the host's other load)")
    print()
    if python and args.sync_reps > 0:
        with tempfile.TemporaryDirectory() as tmp:
            _hf_dir(tmp, SYNC_MODEL, seed=5)
            s = weight_sync(python, tmp, args.sync_reps)
        mb = s["bytes"] / 2**20
        disk = s["disk_write_s"] + s["disk_load_s"]
        print(f"weight sync into one SGLang tp1 server: Qwen2 {SYNC_MODEL['num_layers']} layers, "
              f"hidden {SYNC_MODEL['hidden_size']}, {s['tensors']} tensors, {mb:.1f} MiB fp32 "
              f"(median of {args.sync_reps})")
        print(f"  update_weights_from_distributed (gloo): {s['distributed_s']:.2f} s, "
              f"{mb:.1f} MiB broadcast, {mb / s['distributed_s']:.0f} MiB/s")
        print(f"  disk: write {s['disk_write_s']:.2f} s + update_weights_from_disk "
              f"{s['disk_load_s']:.2f} s = {disk:.2f} s, {s['disk_bytes'] / 2**20:.1f} MiB "
              f"written and read")
        print(f"  ratio disk / distributed: {disk / s['distributed_s']:.2f}x; same greedy tokens "
              f"after both: {s['same_greedy']} (and other tokens on the other weight set: "
              f"{s['base_differs']})")
        print()


def _decode_bench(layout_name, contexts, new, batch, reps):
    import torch
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.engine import SamplingParams
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.models.sharding import reference_weights

    cfg = ModelConfig.tiny("llama")
    rows = []
    with cpu_backend():
        lay = ParallelLayout.parse(layout_name, world_size=dist.get_world_size(), model=cfg)
        mol = build_on_layout(cfg, lay, weights=reference_weights(cfg, seed=7), ddp=False)
        engines = {"kv_cache": EmbeddedEngine(mol),
                   "recompute": EmbeddedEngine(mol, kv_cache=False)}
        params = SamplingParams(temperature=0.0, max_new_tokens=new)
        g = torch.Generator().manual_seed(0)
        engines["kv_cache"].generate([[1, 2, 3]], params)  # warm-up (allocation, first calls)
        for ctx in contexts:
            prompts = torch.randint(8, cfg.vocab_size, (batch, ctx - new), generator=g).tolist()
            row = {"layout": str(lay), "context": ctx, "batch": batch, "new": new}
            tokens = {}
            for mode, engine in engines.items():
                walls, cpus = [], []
                for _ in range(reps if mode == "kv_cache" else max(1, reps // 2)):
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    out = engine.generate(prompts, params)
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                tokens[mode] = [o.token_ids for o in out]
                n = sum(len(o.token_ids) for o in out)
                row[f"{mode}_tok_s"] = n / statistics.median(walls)
                row[f"{mode}_cpu_tok_s"] = n / statistics.median(cpus)
            row["same_tokens"] = tokens["kv_cache"] == tokens["recompute"]
            row["ratio"] = row["kv_cache_tok_s"] / row["recompute_tok_s"]
            row["cpu_ratio"] = row["kv_cache_cpu_tok_s"] / row["recompute_cpu_tok_s"]
            rows.append(row)
        groups.destroy_groups()
    return rows


def _episode_bench(episodes, max_context, action_tokens):
    import torch.distributed as dist

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.envs import make_env
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.agent_loop import AgentLoopConfig, run_episodes, summarize
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.tokenizer import char_tokenizer
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend

    tok = char_tokenizer()
    cfg = ModelConfig.tiny("llama")
    config = AgentLoopConfig(max_turns=21, max_action_tokens=action_tokens,
                             max_context_tokens=max_context, seed=1)
    rows, first = [], None
    with cpu_backend():
        lay = ParallelLayout.parse("tp1", world_size=dist.get_world_size(), model=cfg)
        mol = build_on_layout(cfg, lay, weights=digit_policy_weights(cfg, tok), ddp=False)
        for mode, kv, reuse in (("kv+reuse", True, True), ("kv_cache", True, False),
                                ("recompute", False, False)):
            engine = EmbeddedEngine(mol, kv_cache=kv, reuse_prefix=reuse)
            envs = [make_env("connect_four") for _ in range(episodes)]
            t0, c0 = time.perf_counter(), time.process_time()
            eps = run_episodes(engine, envs, list(range(episodes)), tok, config)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            m = summarize(eps)
            first = first or [e.token_ids for e in eps]
            rows.append({"mode": mode, "episodes": episodes, "seconds": seconds, "cpu": cpu,
                         "episodes_s": episodes / seconds, "cpu_episodes_s": episodes / cpu,
                         "policy_tok_s": m.policy_tokens / seconds, "mean_turns": m.mean_turns,
                         "mean_context": m.mean_context_tokens, "max_context": m.max_context_tokens,
                         "outcomes": f"win {m.win_rate:.2f} loss {m.loss_rate:.2f} "
                                     f"draw {m.draw_rate:.2f} illegal {m.illegal_rate:.2f}",
                         "finish": dict(m.finish_reasons),
                         "same_episodes": [e.token_ids for e in eps] == first})
        groups.destroy_groups()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layouts", default="tp1,tp2",
                    help="rollout layouts; tpN/ppN run on N ranks, dpN on N ranks")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--action-tokens", type=int, default=4, help="tokens sampled per turn")
    ap.add_argument("--engine-cases", default="16x64x32,64x256x128",
                    help="prompts x prompt tokens x new tokens, comma-separated; 'none' skips")
    ap.add_argument("--sglang-venv", default="~/.cache/earl-sglang-cpu",
                    help="SGLang CPU venv (`make sglang` builds it); '' skips SGLang")
    ap.add_argument("--sglang-layouts", default="tp1,tp2,dp2",
                    help="SGLang server layouts for the engines table (tpN: one server of N "
                         "ranks; dpN: N tp1 servers)")
    ap.add_argument("--sync-reps", type=int, default=3,
                    help="weight-sync repetitions, distributed vs disk (0 skips)")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.engine_cases != "none":
        engines_section(args)

    print(f"decode: tiny Llama (4 layers, d=64), batch {args.batch}, {args.new} new tokens, "
          f"greedy; tokens/s include the prefill; wall = elapsed time, cpu = this process's "
          f"CPU time (robust to other load on the host; rank 0)")
    print(f"{'layout':>8} {'context':>8} {'kv tok/s':>18} {'recompute tok/s':>18} "
          f"{'ratio':>14} {'same tokens':>12}")
    print(f"{'':>8} {'':>8} {'wall':>8} {'cpu':>9} {'wall':>8} {'cpu':>9} {'wall':>6} {'cpu':>7}")
    for name in [n for n in args.layouts.split(",") if n not in ("", "none")]:
        world = int("".join(c for c in name if c.isdigit()) or 1)
        rows = run_distributed(_decode_bench, world, name, contexts, args.new, args.batch,
                               args.reps, timeout=1800, collective_timeout_s=600)[0]
        for r in rows:
            print(f"{r['layout']:>8} {r['context']:>8} {r['kv_cache_tok_s']:>8.1f} "
                  f"{r['kv_cache_cpu_tok_s']:>9.1f} {r['recompute_tok_s']:>8.1f} "
                  f"{r['recompute_cpu_tok_s']:>9.1f} {r['ratio']:>5.1f}x {r['cpu_ratio']:>6.1f}x "
                  f"{str(r['same_tokens']):>12}")

    if args.episodes <= 0:
        return
    print(f"\nConnect Four vs random opponent, {args.episodes} episodes batched, digit-policy "
          f"weights, 1 rank (TP1), {args.action_tokens} tokens per turn, max_context "
          f"{args.max_context}")
    rows = run_distributed(_episode_bench, 1, args.episodes, args.max_context,
                           args.action_tokens, timeout=1800)[0]
    for r in rows:
        print(f"{r['mode']:>10}: {r['episodes_s']:.2f} episodes/s wall ({r['seconds']:.1f} s), "
              f"{r['cpu_episodes_s']:.2f} per CPU-second ({r['cpu']:.1f} s), "
              f"{r['policy_tok_s']:.0f} policy tok/s, {r['mean_turns']:.1f} turns/episode, "
              f"context mean {r['mean_context']:.0f} max {r['max_context']}, {r['outcomes']}, "
              f"finish {r['finish']}, same episodes as kv+reuse: {r['same_episodes']}")
    for r in rows[:2]:
        print(f"episodes/s ratio {r['mode']} / recompute: "
              f"{r['episodes_s'] / rows[2]['episodes_s']:.1f}x wall, "
              f"{r['cpu_episodes_s'] / rows[2]['cpu_episodes_s']:.1f}x cpu")


if __name__ == "__main__":
    main()
