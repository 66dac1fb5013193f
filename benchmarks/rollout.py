"""Benchmark: rollout engines against each other, KV cache vs recompute-all, and Connect Four.

0. Engines (issue 15). The same tiny Qwen2 (3 layers, hidden 96, 6 heads, 2 KV groups, fp32),
   one thread, T=1 sampling, ``--engine-cases`` (default 16 prompts x 64 tokens, 32 new; 64 x
   256, 128 new): tokens/s (generated tokens / wall time of one batched call, prefill included,
   median of ``--reps`` interleaved repetitions) of the transformers reference engine (HFEngine,
   outside the CPU backend, which it does not need), the embedded Megatron-Core engine (TP1),
   and a real SGLang CPU server when its venv exists (``--sglang-venv``; the server's radix
   cache is flushed before every repetition, or repeated prompts would be answered from cache).
   Ratios embedded / HF and embedded / SGLang; target >= 1.0.
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
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from earl_megatron.testing.multiproc import run_distributed

DIGIT_LOGIT = 5.0


def digit_policy_weights(cfg, tokenizer, seed: int = 3):
    """Reference weights whose samples are digits 0-6 (see the module docstring)."""
    from earl_megatron.testing.weights import biased_weights

    return biased_weights(cfg, {tokenizer.convert_tokens_to_ids(str(c)): DIGIT_LOGIT
                                for c in range(7)}, seed=seed)


ENGINE_MODEL = dict(family="qwen2", num_layers=3, hidden_size=96, ffn_hidden_size=256,
                    num_attention_heads=6, num_query_groups=2)
SGLANG_SERVE = Path(__file__).resolve().parents[2] / "shared" / "sglang-cpu" / "serve.sh"


def _post(url: str, payload: dict):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        body = r.read()
        # /generate answers JSON; /flush_cache answers plain text ("Cache flushed. ...")
        return json.loads(body) if "json" in r.headers.get("Content-Type", "") else body


def _sglang_generate(url: str, prompts, new: int) -> int:
    """One batched /generate at T=1 (logprobs returned, as the engines return them)."""
    out = _post(url + "/generate", {"input_ids": prompts, "return_logprob": True,
                                    "sampling_params": [{"temperature": 1.0, "max_new_tokens": new,
                                                         "ignore_eos": True}] * len(prompts)})
    return sum(len(o["output_ids"]) for o in out)


def _engines_bench(hf_dir, cases, reps, sglang_url):
    import torch
    from transformers import AutoModelForCausalLM

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.engine import SamplingParams
    from earl_megatron.rollout.hf_engine import HFEngine
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
        walls = {"hf": [], "embedded": [], "sglang": []}
        for _ in range(reps):  # interleaved: every engine sees the same background load
            for name, fn in (("hf", run_hf), ("embedded", run_embedded)):
                t0 = time.perf_counter()
                out = fn(prompts, params)
                walls[name].append((sum(len(o.token_ids) for o in out),
                                    time.perf_counter() - t0))
            if sglang_url:
                _post(sglang_url + "/flush_cache", {})
                t0 = time.perf_counter()
                n = _sglang_generate(sglang_url, prompts, new)
                walls["sglang"].append((n, time.perf_counter() - t0))
        row = {"case": f"{batch} x {plen}, {new} new", "greedy_same": same}
        for name, w in walls.items():
            if w:
                row[name] = w[0][0] / statistics.median(s for _, s in w)
        rows.append(row)
    groups.destroy_groups()
    backend.__exit__(None, None, None)
    return rows


def _start_sglang(venv: Path, model_dir: str, port: int):
    """The SGLang CPU server (one thread) and its URL once /health answers; None if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SGLANG_CPU_OMP_THREADS_BIND="0")
    env.pop("PYTHONPATH", None)
    log = open(Path(model_dir) / "sglang.log", "w")
    # its own session: the server's scheduler and detokenizer children end with its group
    proc = subprocess.Popen(["bash", str(SGLANG_SERVE), str(venv), model_dir, str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # minutes on a busy 2-core host
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(2)
    _stop(proc)
    print(f"SGLang server did not come up (see {log.name}); SGLang column skipped")
    return None, None


def _stop(proc) -> None:
    """End the server we started and its children (its process group), by id."""
    import signal

    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def engines_section(args) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.testing.multiproc import free_port
    from earl_megatron.weights.hf_mapping import to_hf, to_hf_config
    from earl_megatron.models.sharding import reference_weights

    cfg = ModelConfig.tiny(**ENGINE_MODEL)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.engine_cases.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        hc = {k: v for k, v in to_hf_config(cfg).items() if k != "architectures"}
        model = Qwen2ForCausalLM(Qwen2Config(**hc)).float()
        model.load_state_dict(to_hf(cfg, reference_weights(cfg, seed=7)), strict=False)
        model.save_pretrained(tmp)
        venv = Path(args.sglang_venv).expanduser() if args.sglang_venv else None
        proc, url = None, args.sglang_url
        if url:
            print(f"SGLang: the running server at {url} (it must serve the same weights: "
                  f"{ENGINE_MODEL}, reference_weights(seed=7))")
        elif venv and (venv / "bin" / "python").is_file():
            proc, url = _start_sglang(venv, tmp, free_port())
        elif venv:
            print(f"no SGLang venv at {venv}: SGLang column skipped")
        try:
            rows = run_distributed(_engines_bench, 1, tmp, cases, args.reps, url,
                                   timeout=1800)[0]
        finally:
            if proc is not None:
                _stop(proc)
    print("engines: tiny Qwen2 (3 layers, hidden 96), one thread, T=1, tokens/s (wall, median "
          f"of {args.reps} interleaved reps, prefill included)")
    print(f"{'case':>22} {'HF':>8} {'embedded':>9} {'SGLang':>8} {'emb/HF':>7} "
          f"{'emb/SGLang':>10} {'greedy emb == HF':>17}")
    for r in rows:
        sg, emb = r.get("sglang"), r["embedded"]
        sg_tok, sg_ratio = (f"{sg:.0f}", f"{emb / sg:.2f}x") if sg else ("-", "-")
        print(f"{r['case']:>22} {r['hf']:>8.0f} {emb:>9.0f} {sg_tok:>8} "
              f"{emb / r['hf']:>6.2f}x {sg_ratio:>10} {str(r['greedy_same']):>17}")
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
                    help="SGLang CPU venv (../shared/sglang-cpu/setup.sh); '' skips SGLang")
    ap.add_argument("--sglang-url", help="use this running SGLang server instead of starting one")
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
