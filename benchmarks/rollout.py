"""Benchmark: the embedded Megatron-Core engine with a KV cache vs recompute-all, and Connect Four.

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

Target (issue 7): KV cache >= 5x recompute-all at 2,048 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from earl_megatron.testing.multiproc import run_distributed

DIGIT_LOGIT = 5.0


def digit_policy_weights(cfg, tokenizer, seed: int = 3):
    """Reference weights whose samples are digits 0-6 (see the module docstring)."""
    from earl_megatron.testing.weights import biased_weights

    return biased_weights(cfg, {tokenizer.convert_tokens_to_ids(str(c)): DIGIT_LOGIT
                                for c in range(7)}, seed=seed)


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
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

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
