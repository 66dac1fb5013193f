"""The one-GPU check: what a first GPU run of earl_megatron would break, in one command.

On a host with one GPU, torch with CUDA and the project's wheels (no package index needed):

    tools/gpu_wheels.sh                        # where the index is reachable: .whl/, ~20 MB
    python3 benchmarks/gpu_check.py            # on the GPU host, in the repo root (make gpu-check)
    python3 benchmarks/gpu_check.py --dry-run  # anywhere: the same steps on CPU ranks

When ``.whl/`` holds wheels they are installed into a private ``--target`` first, and the repo
is put on PYTHONPATH (nothing is installed into the host's environment). Every step is a
subprocess with its own deadline; a failing step is recorded and the next one runs; the whole
check stays under 8 minutes (the deadlines add up to 7.5).

    step        what runs                                                  passes when
    env         versions: torch, CUDA, GPU, megatron-core, TE, SGLang      always (a record)
    backend     1 rank: the world's device-mapped backend; a CPU and a     world is cpu:gloo,
                CUDA all-reduce on the world and on Megatron's tp group     cuda:nccl; sums right
    demo        the demo's first 2 iterations on 1 GPU (CUDA tensors over  2 records; world.json
                NCCL, CPU ones over gloo), checkpoint at the end            names the backend
    switch      2 ranks sharing the GPU over gloo (cluster.world_backend=   layouts DP2 -> TP2
                gloo: NCCL refuses two ranks on one device), ROLLOUT DP2 -> every iteration
                TRAIN TP2 every iteration (weights + Adam state moved)
    te          the TransformerEngine layer spec, when it imports          TE modules, finite
                                                                            logits; else SKIP
    sglang      rollout.engine=sglang on the GPU, when SGLang is there     2 records; else SKIP
    gpu_memory  benchmarks/gpu_memory.py (memory model vs measured peak)   it exits 0

The table prints last; ``--out`` (default $OUT, else benchmarks/out/gpu_check) receives
gpu_check.json and one log per step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(REPO))

SKIP = 77   # a step's exit status for "not applicable on this host" (as automake's tests)
DEMO = ["run.live_view=false", "run.resume=false", "run.checkpoint_every=0",
        "rollout.episodes_per_iteration=8", "run.eval_episodes=4", "env.eval_opponents=[random]",
        "run.iterations=2"]


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU ranks: the same steps, no GPU")
    ap.add_argument("--out", default=os.environ.get("OUT")
                    or str(REPO / "benchmarks" / "out" / "gpu_check"))
    ap.add_argument("--steps", default="env,backend,demo,switch,te,sglang,gpu_memory")
    ap.add_argument("--step", help=argparse.SUPPRESS)   # run one in-process step (a subprocess)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------- in-process steps
def step_env() -> dict:
    import importlib.util

    import torch
    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)
            if torch.cuda.is_available() else None}
    for name in ("megatron.core", "transformer_engine", "sglang", "apex", "open_spiel", "hydra"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        info[name] = found
    import megatron.core
    info["megatron_core"] = megatron.core.__version__
    print(json.dumps(info))
    print(f"torch {info['torch']} (CUDA {info['cuda']}), GPU {info['gpu']}, megatron-core "
          f"{info['megatron_core']}, TE {info['transformer_engine']}, SGLang {info['sglang']}")
    return info


def step_backend() -> None:
    import torch
    import torch.distributed as dist

    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.dist import device_backends, init_distributed, world_backend

    init_distributed(120.0)
    cuda = torch.cuda.is_available()
    assert dist.get_backend() == world_backend(cuda), dist.get_backend()
    if not cuda:   # the dry run: Megatron's incidental CUDA uses go to the CPU, as in train.py
        from earl_megatron.runtime.cpu_backend import cpu_backend
        cpu_backend().__enter__()
    groups.build_groups(ParallelLayout())
    for name, group in (("world", None), ("tp", groups.tp_group())):
        assert device_backends(group) == device_backends(), (name, device_backends(group))
        tensors = [torch.ones(3)] + ([torch.ones(3, device="cuda")] if cuda else [])
        for t in tensors:
            dist.all_reduce(t, group=group)
            assert t.sum().item() == 3.0, (name, t.device)
        devices = [str(t.device) for t in tensors]
        print(f"{name}: {dist.get_backend(group)}, all-reduce on {devices}")
    groups.destroy_groups()
    dist.destroy_process_group()


def step_te() -> None:
    import torch

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.models.provider import te_available
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.dist import init_distributed

    if not te_available():
        print("TransformerEngine is not importable (or no CUDA device): the local spec runs")
        raise SystemExit(SKIP)
    init_distributed(120.0)
    cfg = ModelConfig.tiny("qwen2")
    model = build_on_layout(cfg, ParallelLayout(), ddp=False).model
    modules = {type(m).__module__ for m in model.modules()}
    assert any("transformer_engine" in m for m in modules), sorted(modules)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda").expand(2, 32)
    logits = model(tokens, pos, None)
    assert torch.isfinite(logits).all()
    print(f"TE spec: {sum('transformer_engine' in m for m in modules)} TE module types, "
          f"logits {tuple(logits.shape)} finite")


# ---------------------------------------------------------------------- subprocess steps
def _torchrun(nproc: int, out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "earl_megatron.train",
            f"run.output_dir={out}", *DEMO, *overrides]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _check_demo(out: Path, backend: str) -> str:
    records, world = _records(out), json.loads((out / "world.json").read_text())
    if len(records) != 2 or world["backend"] != backend:
        raise AssertionError(f"{len(records)} records, backend {world['backend']!r} "
                             f"(expected 2 and {backend!r})")
    return f"backend {world['backend']}, layouts {[r['layouts'] for r in records]}"


def run_steps(args) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = not args.dry_run
    me = [sys.executable, str(Path(__file__).resolve())] + (["--dry-run"] if args.dry_run else [])
    cpu_ranks = 2   # the dry run's "GPU" count: two CPU ranks
    plans = {
        "env": (60, me + ["--step", "env"], None),
        "backend": (60, me + ["--step", "backend"], None),
        "demo": (120, _torchrun(1 if gpu else cpu_ranks, out / "demo"),
                 lambda: _check_demo(out / "demo", "cpu:gloo,cuda:nccl" if gpu else "gloo")),
        "switch": (120, _torchrun(2, out / "switch", "layout=static", "layout.rollout=dp2",
                                  "layout.logprob=dp2", "layout.train=tp2",
                                  *(["cluster.world_backend=gloo"] if gpu else [])),
                   lambda: _check_switch(out / "switch")),
        "te": (45, me + ["--step", "te"], None),
        "sglang": (120, _sglang_command(out / "sglang", gpu),
                   lambda: _check_demo(out / "sglang", "cpu:gloo,cuda:nccl")),
        "gpu_memory": (180, [sys.executable, str(REPO / "benchmarks/gpu_memory.py")]
                       + (["--dry-run"] if args.dry_run else []), None),
    }
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    rows = []
    for name in args.steps.split(","):
        deadline, cmd, check = plans[name]
        t0, log = time.monotonic(), out / f"{name}.log"
        shutil.rmtree(out / name, ignore_errors=True)   # run.resume=false refuses an old run
        if cmd is None:
            rows.append(dict(step=name, status="SKIP", seconds=0.0,
                             detail="SGLang is not installed here (EARL_SGLANG_PYTHON unset)"))
            continue
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=deadline).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        # the step's own last line (C++ warnings at process exit are not results)
        tail = [ln for ln in log.read_text().strip().splitlines()
                if "Warning:" not in ln][-1:] if log.exists() else []
        status, detail = "PASS", " | ".join(tail)[-200:]
        if rc == SKIP:
            status = "SKIP"
        elif rc != 0:
            status, detail = "FAIL", f"exit {rc}: {detail}"
        elif check is not None:
            try:
                detail = check()
            except Exception as e:  # noqa: BLE001 - a failed check is this step's result
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
        rows.append(dict(step=name, status=status, seconds=round(time.monotonic() - t0, 1),
                         detail=detail))
        print(f"{name:<11} {status:<5} {rows[-1]['seconds']:>6.1f} s  {detail}", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    return rows


def _check_switch(out: Path) -> str:
    records = _records(out)
    layouts = [r["layouts"] for r in records]
    if len(records) != 2 or any(lay.get("rollout") != "DP2" or lay.get("train") != "TP2"
                                for lay in layouts):
        raise AssertionError(f"layouts {layouts}")
    return f"layouts {layouts}, backend {json.loads((out / 'world.json').read_text())['backend']}"


def _sglang_command(out: Path, gpu: bool):
    python = os.environ.get("EARL_SGLANG_PYTHON")
    if not gpu or not python:
        return None
    return _torchrun(1, out, "rollout.engine=sglang", "rollout.sglang_device=cuda",
                     f"rollout.sglang_python={python}")


def _install_wheels() -> None:
    """Carried wheels into a private target; the repo and it on PYTHONPATH (children inherit)."""
    wheels = sorted(glob.glob(str(REPO / ".whl" / "*.whl")))
    paths = [str(REPO)]
    if wheels:
        target = "/tmp/earl-gpu-site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--upgrade", "--target", target, *wheels], check=True)
        paths.append(target)
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = paths


def main(argv=None) -> int:
    args = _args(argv)
    if args.step:
        if args.step != "env":
            from earl_megatron.quiet import quiet_known_warnings
            quiet_known_warnings()
        {"env": step_env, "backend": step_backend, "te": step_te}[args.step]()
        return 0
    _install_wheels()
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU host, or pass --dry-run")
    rows = run_steps(args)
    print(f"\n{'step':<11} {'status':<6} {'seconds':>8}  detail")
    for r in rows:
        print(f"{r['step']:<11} {r['status']:<6} {r['seconds']:>8.1f}  {r['detail']}")
    return 0 if all(r["status"] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
