"""Agent endpoint benchmark: what serving agent programs over HTTP costs, and what batching their
calls buys.

One process (world 1, gloo), the embedded engine on a model of the tiny recipe's shape (or
``--layers/--hidden``), the character tokenizer. The same N agent episodes, each ``--turns``
calls of the ``openai`` client (the reply sent back, a user turn appended: every call after the
first extends its row), played three ways in one run:

    direct      the same prompts straight into ``engine.generate``, one call at a time (no HTTP,
                no rendering): the floor for one-at-a-time
    serial      through the endpoint, rollout.agent_concurrency = 1
    concurrent  through the endpoint, agent_concurrency = N: calls that arrive together are one
                ``generate`` (agents/broker.py)

Printed: calls/s of each, the mean batch size, and the ratios. Its last line:
``agent endpoint: concurrent / serial X.XXx calls/s, serial / direct Y.YYx``
(X: what batching buys; Y: the endpoint's overhead per call, HTTP + rendering + token
bookkeeping, as a share of a one-at-a-time decode: near 1 means the overhead is small).

Run:  python benchmarks/agent_endpoint.py [--episodes 16] [--turns 3] [--tokens 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _agent(turns: int, tokens: int):
    def agent(task, base_url, api_key, model):
        from openai import OpenAI

        client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": task["prompt"]}]
        for _ in range(turns):
            r = client.chat.completions.create(model=model, messages=msgs, max_tokens=tokens)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "go on"}]
        return 1.0
    return agent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()

    import threading

    import torch

    from earl_megatron.agents.broker import Broker, ReplicaDriver
    from earl_megatron.agents.programs import run_agents
    from earl_megatron.agents.server import AgentServer, ServerLimits
    from earl_megatron.config.model import ModelConfig
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.rollout.engine import SamplingParams
    from earl_megatron.rollout.tokenizer import char_tokenizer
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.runtime.dist import init_distributed

    init_distributed(600, "gloo")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tok = char_tokenizer()
    cfg = ModelConfig.tiny(vocab_size=128, num_layers=args.layers, hidden_size=args.hidden)
    tasks = [{"prompt": f"question {i}: what is {i} + {i}?"} for i in range(args.episodes)]
    agent = _agent(args.turns, args.tokens)
    with cpu_backend():
        model = build_on_layout(cfg, ParallelLayout(), ddp=False, seed=1)
        engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, prompts="replica")
        limits = ServerLimits(max_context_tokens=cfg.max_position_embeddings,
                              max_action_tokens=args.tokens, max_turns=args.turns)

        def through_endpoint(concurrency: int):
            broker = Broker()
            server = AgentServer(tok, broker, limits)
            server.start()
            driver = ReplicaDriver(engine)
            box = {}
            th = threading.Thread(target=lambda: box.update(out=run_agents(
                server, tasks, agent, None, concurrency=concurrency, timeout_s=600)))
            t0 = time.perf_counter()
            th.start()
            driver.lead(broker, lambda: not th.is_alive(), lambda k: k)
            th.join()
            seconds = time.perf_counter() - t0
            server.stop()
            assert all(not o.lost for o in box["out"]), [o.error for o in box["out"]]
            prompts = [(r.token_ids, r.loss_mask) for o in box["out"]
                       for r in o.episode.tokens.rows()]
            return seconds, driver.batches, prompts

        _, _, rows = through_endpoint(args.episodes)          # warm-up; its calls' prompts
        # direct: each call's prompt (the row up to that call's sampled tokens) decoded alone
        prompts = []
        for ids, mask in rows:
            for k in range(1, len(mask)):
                if mask[k] and not mask[k - 1]:
                    prompts.append(list(ids[:k]))
        params = SamplingParams(max_new_tokens=args.tokens,
                                stop_token_ids=(tok.convert_tokens_to_ids("<|end|>"),), seed=0)

        def direct() -> float:
            t0 = time.perf_counter()
            for p in prompts:
                engine.generate([p], params)
            return time.perf_counter() - t0

        # direct before and after the endpoint runs (their mean): load drifts on a shared host
        first = direct()
        serial_s, serial_batches, _ = through_endpoint(1)
        conc_s, conc_batches, _ = through_endpoint(args.episodes)
        direct_s = (first + direct()) / 2
        engine.close()
    calls = args.episodes * args.turns
    print(f"{args.episodes} episodes x {args.turns} calls, {args.tokens} tokens a call, model "
          f"{args.layers} layers x {args.hidden}")
    print(f"  direct      {len(prompts) / direct_s:8.1f} calls/s   ({direct_s:.2f} s)")
    print(f"  serial      {calls / serial_s:8.1f} calls/s   ({serial_s:.2f} s, "
          f"{serial_batches} generate calls)")
    print(f"  concurrent  {calls / conc_s:8.1f} calls/s   ({conc_s:.2f} s, {conc_batches} "
          f"generate calls, {calls / conc_batches:.1f} calls each)")
    print(f"agent endpoint: concurrent / serial {serial_s / conc_s:.2f}x calls/s, "
          f"serial / direct {serial_s / direct_s:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
