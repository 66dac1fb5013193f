"""Conversion throughput (MB/s) and peak RSS against model size: HF -> Megatron-Core -> HF.

Two random Llama-shaped models with the same layer width and different depths (default ~50 MB
with 1 layer and ~200 MB with 7 layers, fp32) are written as HF directories; each conversion
runs in a fresh subprocess that reports

- MB/s: tensor bytes converted / wall seconds of the conversion call (imports excluded); cpu s:
  CPU seconds it used (with its forked writers), which a loaded machine does not inflate;
- base: RSS after the imports, before converting (torch + Megatron-Core themselves);
- peak: ru_maxrss of the process; writers: ru_maxrss of the largest child (dist_checkpointing
  forks its file writers); growth = peak - base.

With a bounded ``--part-mb`` the growth of HF -> Megatron-Core stays near one part (plus the
largest tensor) whatever the depth; ``part 0`` (no bound: the whole model in one save) is the
contrast and grows with the model. Megatron-Core -> HF reads one part of layer regions at a time
(the first ``--part-mb``) and writes HF shards of ``--shard-mb``: its growth follows part + shard.
The writers column counts pages the forked writers share with the parent, so it is not memory on
top of peak.

    python benchmarks/convert.py                    # the default table (~1 min when idle)
    python benchmarks/convert.py --layers 1,7 --hidden 768 --part-mb 16,0
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `python benchmarks/NAME.py` puts benchmarks/, not the repository root, first on sys.path: put
# the root first, so that this checkout's earl_megatron (not an installed copy) and
# `benchmarks.*` (what worker processes import by name) are what the benchmark imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _child(direction: str, src: str, dst: str, part_mb: float, shard_mb: float) -> None:
    """One conversion in this fresh process; ``part_mb`` 0 means unbounded."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import psutil
    import torch

    torch.set_num_threads(1)
    from megatron.core import dist_checkpointing  # noqa: F401  (imports before the baseline)
    from megatron.core.models.gpt import GPTModel  # noqa: F401

    from earl_megatron.weights import convert

    base = psutil.Process().memory_info().rss
    cpu0 = _cpu_seconds()
    part = int(part_mb * 2**20) if part_mb > 0 else 1 << 62
    if direction == "hf2mcore":
        stats = convert.convert_hf_to_mcore(src, dst, part_bytes=part)
    else:
        stats = convert.convert_mcore_to_hf(src, dst, part_bytes=part,
                                            max_shard_bytes=int(shard_mb * 2**20))
    print(json.dumps({
        "bytes": stats.bytes, "seconds": stats.seconds, "parts": stats.parts, "base": base,
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "cpu": _cpu_seconds() - cpu0}))


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children (load-independent)."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _make_model(path: Path, layers: int, hidden: int) -> tuple[int, int]:
    """Random HF directory; returns (bytes, largest tensor bytes)."""
    import torch

    from earl_megatron.config.model import ModelConfig
    from earl_megatron.weights import hf_mapping as hfm
    from earl_megatron.weights.hf_io import HFWriter

    cfg = ModelConfig(family="llama", num_layers=layers, hidden_size=hidden,
                      ffn_hidden_size=hidden * 8 // 3 // 64 * 64, num_attention_heads=hidden // 64,
                      num_query_groups=4, vocab_size=4096)
    g = torch.Generator().manual_seed(0)
    w = HFWriter(path, max_shard_bytes=64 << 20)
    largest = 0
    for name, shape in hfm.hf_shapes(cfg).items():
        t = torch.randn(*shape, generator=g) * 0.02
        largest = max(largest, t.numel() * 4)
        w.add(name, t)
    w.finish(hfm.to_hf_config(cfg))
    return w.total_bytes, largest


def _run(direction: str, src: Path, dst: Path, part_mb: float, shard_mb: float = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", direction, str(src), str(dst), str(part_mb),
           str(shard_mb)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"{direction} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="1,7", help="depths to compare (same width)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--part-mb", default="16,0", help="HF->Megatron part sizes; 0 = unbounded")
    p.add_argument("--shard-mb", type=float, default=32.0, help="HF shard size for MC->HF")
    p.add_argument("--child", nargs=5, metavar=("DIR", "SRC", "DST", "PART_MB", "SHARD_MB"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child[:3], float(args.child[3]), float(args.child[4]))
        return
    mib = 2**20
    rows = []
    with tempfile.TemporaryDirectory(prefix="convert_bench_") as tmp:
        for layers in (int(x) for x in args.layers.split(",")):
            src = Path(tmp) / f"hf_{layers}"
            size, largest = _make_model(src, layers, args.hidden)
            for part_mb in (float(x) for x in args.part_mb.split(",")):
                mc = Path(tmp) / f"mc_{layers}_{part_mb:g}"
                r = _run("hf2mcore", src, mc, part_mb)
                rows.append((layers, size, largest, "HF->MC", f"{part_mb:g}" if part_mb else
                             "none", r))
            back = Path(tmp) / f"back_{layers}"
            part_mb = float(args.part_mb.split(",")[0])
            r = _run("mcore2hf", mc, back, part_mb, args.shard_mb)
            rows.append((layers, size, largest, "MC->HF", f"{part_mb:g}+{args.shard_mb:g}", r))
    print(f"hidden {args.hidden}, fp32, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.0f} (RSS in MiB)")
    head = (f"{'layers':>6} {'model MiB':>9} {'largest':>7} {'direction':>9} {'part MiB':>9} "
            f"{'parts':>5} {'MB/s':>7} {'cpu s':>6} {'base':>6} {'peak':>6} {'growth':>6} "
            f"{'writers':>7}")
    print(head)
    print("-" * len(head))
    for layers, size, largest, direction, part, r in rows:
        print(f"{layers:>6} {size / mib:>9.1f} {largest / mib:>7.1f} {direction:>9} {part:>9} "
              f"{r['parts']:>5} {r['bytes'] / 1e6 / r['seconds']:>7.1f} {r.get('cpu', 0):>6.1f} "
              f"{r['base'] / mib:>6.0f} "
              f"{r['peak'] / mib:>6.0f} {(r['peak'] - r['base']) / mib:>6.0f} "
              f"{r['children'] / mib:>7.0f}")


if __name__ == "__main__":
    main()
