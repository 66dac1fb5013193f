"""Serve a checkpoint over OpenAI's chat completions API, to try a policy with any client.

    earl serve run.init=DIR [rollout.agent_port=8000] [rollout.agent_host=..]
    python -m earl_megatron.serve run.init=DIR (the same, the port from the config: 0, any)
    -> serving runs/x/.../hf at http://127.0.0.1:8000/v1 (model "policy", api key earl-...)

``run.init`` is any checkpoint the trainer starts from (an HF directory, a converted one, a
trainer checkpoint's iteration folder: give that one the run's ``rollout.tokenizer``, it holds
no tokenizer); the recipes and overrides are the trainer's (Hydra), so
the tokenizer, ``rollout.max_context_tokens`` and ``rollout.temperature``/``top_p`` (the
defaults of a request that names none) mean what they mean in training. The endpoint is the
training one (agents/server.py) with each request standing alone (no episode, nothing
recorded), the request's own temperature, top_p and seed honoured, and no per-call cap: a
request's max_tokens is honoured up to the context, and one without samples up to the context
(or the model's end of turn), as OpenAI's API does (training's ``rollout.max_action_tokens`` is
not used here). ``rollout.agent_public_url``, ``agent_max_body_mb`` and ``agent_max_batch`` are
the training endpoint's. ``earl serve`` runs this with ``rollout.agent_port=8000`` unless a port
is given. ``EARL_API_KEY`` sets the key (default: a
fresh one, printed). One process, the embedded engine on one rank (world 1); Ctrl-C stops it.
"""

from __future__ import annotations

import os
import signal
import threading


def serve(cfg, *, ready=None, stop: threading.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM); ``ready(server)`` once listening.
    On a host without CUDA, Megatron runs under the CPU backend, as in training."""
    import contextlib

    import torch

    backend = contextlib.nullcontext()
    if not torch.cuda.is_available():
        from earl_megatron.runtime.cpu_backend import cpu_backend
        backend = cpu_backend()
    with backend:
        _serve(cfg, ready=ready, stop=stop)


def _serve(cfg, *, ready=None, stop: threading.Event | None = None) -> None:
    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()
    import torch

    from earl_megatron.agents.broker import Broker, ReplicaDriver
    from earl_megatron.agents.server import AgentServer, ServerLimits
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.rollout.embedded_engine import EmbeddedEngine
    from earl_megatron.runtime.dist import init_distributed
    from earl_megatron.train import make_tokenizer
    from earl_megatron.trainer.model_pair import build_model_pair

    rank, world = init_distributed(cfg.cluster.collective_timeout_s, "gloo")
    if world != 1:
        raise SystemExit("earl_megatron.serve runs as one process (world 1); start it with "
                         "python -m, not torchrun")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tok = make_tokenizer(cfg)
    pair = build_model_pair(cfg.model, ParallelLayout(), None, optimizer=None,
                            seed=cfg.run.seed, init=cfg.run.init)
    engine = EmbeddedEngine(pair.policy, pad_token_id=tok.pad_token_id, prompts="replica",
                            prefill_tokens=cfg.rollout.prefill_tokens)
    r = cfg.rollout
    limits = ServerLimits(max_context_tokens=r.max_context_tokens or
                          cfg.model.max_position_embeddings,
                          max_action_tokens=None, max_turns=2**31 - 1,
                          temperature=r.temperature, top_p=r.top_p, honour_sampling=True)
    broker = Broker(max_batch=r.agent_max_batch)
    broker.open_episodes = 1   # each request stands alone: send it at once
    server = AgentServer(tok, broker, limits, host=r.agent_host, port=r.agent_port,
                         api_key=os.environ.get("EARL_API_KEY"), per_request_episodes=True,
                         public_url=r.agent_public_url,
                         max_body_bytes=int(r.agent_max_body_mb * 2**20))
    url = server.start()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    print(f"serving {cfg.run.init or 'a fresh model'} at {url}/v1 (model "
          f"{server.model_name!r}, api key {server.api_key})", flush=True)
    if ready is not None:
        ready(server)
    try:
        ReplicaDriver(engine).lead(broker, stop.is_set, lambda k: k)
    finally:
        server.stop()
        engine.close()


def main() -> None:
    from earl_megatron.train import hydra_entry
    hydra_entry(serve)


if __name__ == "__main__":
    main()
