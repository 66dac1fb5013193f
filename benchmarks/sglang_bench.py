"""SGLang sections of benchmarks/rollout.py: server layouts' tokens/s, and weight sync.

Servers are the project's own (``SGLangEngine`` on ``device="cpu"``: the CPU flags and
environment of rollout/sglang_server.py, a venv built by ``make sglang``), so a clone without
anything else runs it.

- ``layout_rates``: the same prompts as the HF / embedded columns, T=1, ``max_new_tokens`` new
  tokens each, on SGLang in each layout of ``layouts`` ("tp1", "tp2", "dp2": one server of tp
  ranks, or dp servers of tp1 sharing the batch); every server's radix cache is flushed before
  each repetition. Tokens/s = generated tokens / wall time of one ``generate`` (median of reps).
- ``weight_sync``: one tp1 server; the full HF state dict of a model pushed (a) with
  ``update_weights_from_distributed`` (gloo broadcasts from this process, the trainer's path)
  and (b) written as an HF directory and loaded with ``update_weights_from_disk`` (the
  fallback). Seconds (median of reps) and bytes moved for each. The pushes alternate between
  two weight sets so each one changes what is served; after both paths the served greedy tokens
  must be equal, and differ from the other set's (or the check could not tell them apart).
"""

from __future__ import annotations

import socket
import statistics
import tempfile
import time
from pathlib import Path


def _engine(python: str, model_dir: str, tp: int, dp: int, log_dir: str):
    from earl_megatron.rollout.sglang_engine import SGLangConfig, SGLangEngine

    return SGLangEngine(SGLangConfig(python=python, model_path=model_dir, num_servers=dp,
                                     tp_size=tp, device="cpu", startup_timeout_s=900,
                                     log_dir=log_dir))


def _parse(layout: str) -> tuple[int, int]:
    kind, n = layout[:2], int(layout[2:])
    if kind not in ("tp", "dp") or n < 1:
        raise ValueError(f"SGLang layout {layout!r}: use tpN or dpN")
    return (n, 1) if kind == "tp" else (1, n)


def layout_rates(python: str, model_dir: str, cases, reps: int,
                 layouts=("tp1", "tp2", "dp2")) -> dict[str, list[float]]:
    """{layout: [tokens/s per case]} (cases: (prompts, prompt tokens, new tokens))."""
    import torch

    from earl_megatron.rollout.engine import SamplingParams

    out: dict[str, list[float]] = {}
    vocab = _vocab(model_dir)
    for name in layouts:
        tp, dp = _parse(name)
        with tempfile.TemporaryDirectory() as logs, _engine(python, model_dir, tp, dp,
                                                            logs) as engine:
            rates = []
            g = torch.Generator().manual_seed(0)  # the same prompts as the HF/embedded columns
            for batch, plen, new in cases:
                prompts = torch.randint(8, vocab, (batch, plen), generator=g).tolist()
                params = SamplingParams(temperature=1.0, max_new_tokens=new)
                engine.generate(prompts[:1], params)  # warm-up
                walls = []
                for _ in range(reps):
                    engine.flush_cache()
                    t0 = time.perf_counter()
                    gens = engine.generate(prompts, params)
                    walls.append((sum(len(x.token_ids) for x in gens), time.perf_counter() - t0))
                rates.append(walls[0][0] / statistics.median(w for _, w in walls))
            out[name] = rates
    return out


def _vocab(model_dir: str) -> int:
    import json

    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weight_sync(python: str, model_dir: str, reps: int, seed: int = 11) -> dict:
    """Seconds and bytes of a full push, distributed vs from disk (module docstring)."""
    import torch
    from safetensors.torch import load_file

    from earl_megatron.rollout.engine import SamplingParams
    from earl_megatron.rollout.sglang_weights import trainer_weight_update_group
    from earl_megatron.weights.hf_io import write_hf_dir

    config = __import__("json").loads((Path(model_dir) / "config.json").read_text())
    files = sorted(Path(model_dir).glob("*.safetensors"))
    base = {k: v for f in files for k, v in load_file(str(f)).items()}
    g = torch.Generator().manual_seed(seed)
    new = {k: (v + 0.02 * torch.randn(v.shape, generator=g)).contiguous()
           for k, v in sorted(base.items())}
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    prompts = [[3, 9, 17, 5], [4, 4, 8]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    # alternate the new and the base weights so that every timed load really changes what is
    # served; an odd count ends on the new weights for the greedy comparison
    states = [new, base]
    n = reps if reps % 2 else reps + 1
    dist_s, write_s, load_s, disk_bytes = [], [], [], 0
    with tempfile.TemporaryDirectory() as tmp, _engine(python, model_dir, 1, 1,
                                                       tmp + "/logs") as engine:
        port = _free_port()
        joined = engine.start_init_weights_update_group("127.0.0.1", port,
                                                        group_name="earl_bench", backend="gloo")
        group = trainer_weight_update_group("127.0.0.1", port, engine.weight_update_world_size,
                                            group_name="earl_bench", backend="gloo")
        joined.result(timeout=600)
        try:
            for rep in range(n):
                t0 = time.perf_counter()
                engine.push_weights_distributed(sorted(states[rep % 2].items()), group,
                                                group_name="earl_bench",
                                                weight_version=f"bench{rep}")
                dist_s.append(time.perf_counter() - t0)
            after_dist = [x.token_ids for x in engine.generate(prompts, greedy)]
            engine.update_weights(model_dir, weight_version="base")  # untimed: back to base
            on_base = [x.token_ids for x in engine.generate(prompts, greedy)]
            for rep in range(n):
                out = Path(tmp) / f"weights-{rep}"
                t0 = time.perf_counter()
                write_hf_dir(out, states[rep % 2], config)
                t1 = time.perf_counter()
                engine.update_weights(out, weight_version=f"disk{rep}")
                load_s.append(time.perf_counter() - t1)
                write_s.append(t1 - t0)
                disk_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
            after_disk = [x.token_ids for x in engine.generate(prompts, greedy)]
        finally:
            engine.destroy_weights_update_group("earl_bench")
    med = statistics.median
    return {"tensors": len(new), "bytes": nbytes, "distributed_s": med(dist_s),
            "disk_write_s": med(write_s), "disk_load_s": med(load_s), "disk_bytes": disk_bytes,
            "same_greedy": after_dist == after_disk, "base_differs": on_base != after_disk}
