"""HF <-> Megatron-Core distributed checkpoints, streamed; and the trainer's ``load_policy``.

A converted checkpoint is a ``megatron.core.dist_checkpointing`` directory (torch_dist backend)
whose keys and global shapes are those of ``GPTModel.sharded_state_dict()`` of the local spec at
TP1/PP1 (stacked ``decoder.layers.*`` keys, the spec's key renames such as ``input_layernorm ->
self_attention.linear_qkv.layer_norm_weight``), so ``dist_checkpointing.load`` reshards it on load
into a model of ANY layout. Next to it: ``earl_model_config.json`` (the ModelConfig) and ``hf/``
(the source config.json and tokenizer files, used when converting back).

How memory stays near one part, not the model (``part_bytes``, default 256 MiB):

    HF shards --read 1 tensor--> combine (qkv interleave, [gate; up]) --> pending part
    pending part >= part_bytes --> dist_checkpointing.save(part, tmp/part_k)   (no integrity
                                   check: a part covers only some layers of a stacked key)
    all parts --> move their .distcp files into the checkpoint and merge their DCP .metadata
                  (chunk lists per key, storage index with renamed files), as Megatron-Core's own
                  ``remove_sharded_tensors`` rewrites that file

Keys and shapes come from a GPTModel built on the meta device (no weights allocated). Converting
back reads up to ``part_bytes`` of layer regions at a time (``read_regions``: torch DCP's load with
a planner that asks for one layer of a stacked key) and streams HF shards out (hf_io.HFWriter).
Conversions run in one process on CPU.

Invariant: HF -> Megatron-Core -> HF returns every tensor bit-exact (dtype kept, no casts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.checkpoint import CONFIG_JSON
from earl_megatron.weights import hf_mapping as hfm
from earl_megatron.weights.hf_io import HFCheckpoint, HFWriter, release_freed_memory

HF_SUBDIR = "hf"


@dataclasses.dataclass(frozen=True)
class ConversionStats:
    tensors: int
    bytes: int
    seconds: float
    parts: int

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


# ----------------------------------------------------------------------------- configs
def is_mcore_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / CONFIG_JSON).is_file() and (p / "metadata.json").is_file()


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a converted checkpoint or of an HF directory (no tensors read)."""
    p = Path(path)
    if is_mcore_checkpoint(p):
        return ModelConfig(**json.loads((p / CONFIG_JSON).read_text()))
    if (p / "config.json").is_file():
        return hfm.from_hf_config(json.loads((p / "config.json").read_text()))
    raise FileNotFoundError(f"{p} is neither a converted Megatron-Core checkpoint ({CONFIG_JSON} "
                            "+ metadata.json) nor a Hugging Face directory (config.json)")


# ----------------------------------------------------------------------------- process setup
@contextlib.contextmanager
def conversion_process(cfg: ModelConfig) -> Iterator[None]:
    """A 1-rank gloo world with TP1/PP1 Megatron groups and the CPU backend (tools, tests)."""
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend

    if torch.cuda.is_available():
        raise RuntimeError("checkpoint conversion runs on CPU: set CUDA_VISIBLE_DEVICES= (the "
                           "tools in tools/ do)")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"conversion runs in a single process, not in a world of "
                           f"{dist.get_world_size()} ranks; use tools/convert_hf_to_mcore.py")
    try:
        with cpu_backend():
            groups.build_groups(ParallelLayout(), cfg)
            try:
                yield
            finally:
                groups.destroy_groups()
    finally:
        if own:
            dist.destroy_process_group()


def sharded_template(cfg: ModelConfig) -> dict[str, Any]:
    """GPTModel.sharded_state_dict() at TP1/PP1 built on the meta device: metadata, no weights."""
    from earl_megatron.models.provider import build_gpt_model, transformer_config

    layout = ParallelLayout()
    tcfg = transformer_config(cfg, layout)
    tcfg.perform_initialization = False
    with torch.device("meta"):
        model = build_gpt_model(cfg, layout, pre_process=True, post_process=True, config=tcfg)
    return dict(model.sharded_state_dict())


def _check_shape(entry, tensor: torch.Tensor, name: str) -> None:
    expect = tuple(getattr(entry, "local_shape", None) or entry.data.shape)
    if tuple(tensor.shape) != expect:
        raise ValueError(f"{name}: tensor of shape {tuple(tensor.shape)} but the model config "
                         f"implies {expect}; the weights and config do not belong together")


def _with_data(entry, tensor: torch.Tensor, name: str):
    _check_shape(entry, tensor, name)
    if hasattr(entry, "dtype"):
        return dataclasses.replace(entry, data=tensor, dtype=tensor.dtype)
    return dataclasses.replace(entry, data=tensor)


def _part_state_dict(pending: dict[str, tuple[str, Optional[int], torch.Tensor]]
                     ) -> tuple[dict[str, Any], dict[str, int]]:
    """One part's ShardedTensors, stacked keys cut to the part's own layer range.

    A part holds layers [a, b) of a stacked key. It is saved as a (b - a, ...) tensor because in a
    1-rank world Megatron-Core's save cannot describe chunks that no rank holds; ``merge_parts``
    shifts the chunks by ``a`` (returned per key) into the full (num_layers, ...) tensor. Plain
    chunks replace the SwiGLU factory: the stored global tensor [gate; up] is the same and
    resharding on load reads any chunking.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    by_key: dict[str, list[int]] = {}
    for key, layer, _ in pending.values():
        if layer is not None:
            by_key.setdefault(key, []).append(layer)
    shift = {}
    for key, layers in by_key.items():
        a, b = min(layers), max(layers) + 1
        if sorted(layers) != list(range(a, b)):
            raise AssertionError(f"{key}: layers {layers} of one part are not contiguous")
        shift[key] = a
    sd = {}
    for name, (key, layer, t) in pending.items():
        if layer is None:
            sd[name] = ShardedTensor.from_rank_offsets(key, t, replica_id=0)
        else:
            a = shift[key]
            n = len(by_key[key])
            sd[name] = ShardedTensor.from_rank_offsets(key, t, (0, layer - a, n), replica_id=0,
                                                       prepend_axis_num=1)
    return sd, shift


@contextlib.contextmanager
def _removed_on_error(path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else None


def _progress(enabled: bool, what: str):
    """A rich progress bar in bytes (disabled: a no-op with the same interface)."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress("[bold]" + what, BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), disable=not enabled, transient=True)


# ----------------------------------------------------------------------------- HF -> Megatron
def convert_hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        part_bytes: int = 256 << 20, progress: bool = False) -> ConversionStats:
    """HF directory -> dist_checkpointing directory loadable under any layout (one process)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    t0 = time.perf_counter()
    cfg = read_model_config(hf_dir)  # an unsupported architecture fails before any file check
    ckpt = HFCheckpoint(hf_dir)
    ckpt.check_against(hfm.hf_shapes(cfg))
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new output directory")
    tmp = out / ".parts"
    tmp.mkdir(parents=True)
    rules = hfm.rules(cfg)
    total = sum(ckpt.nbytes(n) for r in rules for n in r.hf)
    done = n_tensors = 0
    part_dirs: list[Path] = []
    shifts: list[dict[str, int]] = []
    with conversion_process(cfg), _removed_on_error(tmp):
        template = sharded_template(cfg)
        objects = {k: v for k, v in template.items() if isinstance(v, ShardedObject)}
        pending: dict[str, tuple[str, Optional[int], torch.Tensor]] = {}
        pending_bytes = 0

        def flush():
            nonlocal pending, pending_bytes, objects
            sd, shift = _part_state_dict(pending)
            sd.update(objects)  # extra-state objects are bytes: any one part may hold them
            objects = {}
            d = tmp / f"part_{len(part_dirs):05d}"
            d.mkdir()
            dist_checkpointing.save(sd, str(d), validate_access_integrity=False)
            part_dirs.append(d)
            shifts.append(shift)
            pending, pending_bytes = {}, 0
            del sd
            release_freed_memory()

        prog = _progress(progress, "HF -> Megatron-Core")
        with prog:
            task = prog.add_task("convert", total=total)
            for rule in rules:
                full = hfm.combine(rule, cfg, [ckpt.read(s) for s in hfm.sources(rule, cfg)])
                if rule.name not in template:
                    raise KeyError(f"{rule.name} is not in GPTModel.sharded_state_dict(); "
                                   "the Megatron-Core version renamed it: update hf_mapping")
                entry = template[rule.name]
                _check_shape(entry, full, rule.name)
                pending[rule.name] = (entry.key, _layer_of(rule.name), full)
                nbytes = full.numel() * full.element_size()
                pending_bytes += nbytes
                done += nbytes
                n_tensors += 1
                prog.update(task, completed=done)
                if pending_bytes >= part_bytes:
                    flush()
            if pending or objects:
                flush()
    merge_parts(part_dirs, shifts, cfg.num_layers, out)
    shutil.rmtree(tmp)
    (out / CONFIG_JSON).write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    (out / HF_SUBDIR).mkdir()
    for src in [ckpt.path / "config.json"] + ckpt.tokenizer_files():
        shutil.copy2(src, out / HF_SUBDIR / src.name)
    return ConversionStats(n_tensors, done, time.perf_counter() - t0, len(part_dirs))


def merge_parts(part_dirs: list[Path], shifts: list[dict[str, int]], num_layers: int,
                out: Path) -> None:
    """Merge the parts' torch_dist checkpoints into one (files moved, DCP .metadata rewritten).

    Part k's chunks of a stacked key move by ``shifts[k][key]`` layers along dim 0 and the key's
    size becomes (num_layers, ...); every chunk's storage entry follows its file's new name.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorStorageMetadata)

    def moved(offsets, by: int) -> torch.Size:
        return torch.Size((offsets[0] + by, *offsets[1:]))

    state_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    first: Optional[Metadata] = None
    for k, (d, shift) in enumerate(zip(part_dirs, shifts)):
        md = FileSystemReader(str(d)).read_metadata()
        first = first or md
        renamed = {}
        for f in sorted(d.glob("*.distcp")):
            renamed[f.name] = f"__part{k:05d}{f.name}"
            os.replace(f, out / renamed[f.name])
        for key, m in md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                by = shift.get(key)
                chunks = m.chunks if by is None else [
                    ChunkStorageMetadata(moved(c.offsets, by), c.sizes) for c in m.chunks]
                size = m.size if by is None else torch.Size((num_layers, *m.size[1:]))
                if key in state_meta:
                    prev = state_meta[key]
                    if prev.size != size or prev.properties.dtype != m.properties.dtype:
                        raise ValueError(f"parts disagree on {key}: {prev.size} vs {size}")
                    prev.chunks.extend(chunks)
                else:
                    state_meta[key] = TensorStorageMetadata(m.properties, size, list(chunks))
            elif key in state_meta:
                raise ValueError(f"object {key} saved in two parts")
            else:
                state_meta[key] = m
        for idx, info in (md.storage_data or {}).items():
            by = shift.get(idx.fqn)
            if by is not None:
                idx = MetadataIndex(idx.fqn, moved(idx.offset, by), idx.index)
            storage[idx] = dataclasses.replace(info, relative_path=renamed[info.relative_path])
        planner.update(md.planner_data or {})
    assert first is not None, "no parts to merge"
    merged = dataclasses.replace(first, state_dict_metadata=state_meta, storage_data=storage,
                                 planner_data=planner)
    with open(out / ".metadata", "wb") as f:
        pickle.dump(merged, f)
    for name in ("metadata.json", "common.pt"):
        shutil.copy2(part_dirs[0] / name, out / name)


# ----------------------------------------------------------------------------- Megatron -> HF
def convert_mcore_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        part_bytes: int = 256 << 20, max_shard_bytes: int = 2 << 30,
                        tokenizer_from: Optional[str | os.PathLike] = None,
                        progress: bool = False) -> ConversionStats:
    """Converted checkpoint -> HF directory (config.json, safetensors shards, tokenizer files)."""
    from torch.distributed.checkpoint import FileSystemReader

    t0 = time.perf_counter()
    src = Path(ckpt_dir)
    if not is_mcore_checkpoint(src):
        raise FileNotFoundError(f"{src} is not a converted checkpoint (no {CONFIG_JSON} or "
                                "metadata.json); convert it with tools/convert_hf_to_mcore.py")
    cfg = read_model_config(src)
    base_path = src / HF_SUBDIR / "config.json"
    base = json.loads(base_path.read_text()) if base_path.is_file() else None
    extra = Path(tokenizer_from) if tokenizer_from else src / HF_SUBDIR
    copy = [p for p in extra.iterdir() if p.is_file() and p.name != "config.json"] \
        if extra.is_dir() else []
    writer = HFWriter(out_dir, max_shard_bytes=max_shard_bytes)
    rules = hfm.rules(cfg)
    by_name = {r.name: r for r in rules}
    n_parts = done = 0
    with conversion_process(cfg):
        template = sharded_template(cfg)
    stored = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    prog = _progress(progress, "Megatron-Core -> HF")
    with prog:
        task = prog.add_task("convert", total=sum(_nbytes(template[r.name]) for r in rules))
        i = 0
        while i < len(rules):
            requests: dict[str, tuple[str, tuple[int, ...], torch.Tensor]] = {}
            size = 0
            while i < len(rules) and (not requests or size < part_bytes):
                r = rules[i]
                requests[r.name] = _region_request(template[r.name], r.name, stored, src)
                size += _nbytes(template[r.name])
                i += 1
            read_regions(src, requests)
            n_parts += 1
            for name, (_, _, dest) in requests.items():
                full = dest[0] if _layer_of(name) is not None else dest
                for hf_name, t in hfm.split(by_name[name], cfg, full).items():
                    writer.add(hf_name, t)
                done += _nbytes(template[name])
                prog.update(task, completed=done)
            del requests, full
            release_freed_memory()
    writer.finish(hfm.to_hf_config(cfg, base), copy)
    return ConversionStats(len(rules), writer.total_bytes, time.perf_counter() - t0, n_parts)


def _region_request(entry, name: str, stored: dict, src: Path):
    """(checkpoint key, offsets, empty destination) for one Megatron tensor (layer i of a
    stacked key is the (1, ...) region at offset i)."""
    if entry.key not in stored:
        raise KeyError(f"{src} has no tensor {entry.key!r}; it was not written for this model "
                       "config (earl_model_config.json)")
    meta = stored[entry.key]
    shape = tuple(entry.data.shape)
    layer = _layer_of(name)
    if layer is None:
        offsets, shape = (0,) * len(shape), shape
    else:
        offsets, shape = (layer,) + (0,) * len(shape), (1,) + shape
    if any(o + n > m for o, n, m in zip(offsets, shape, meta.size)):
        raise ValueError(f"{src}: {entry.key} has shape {tuple(meta.size)}, too small for "
                         f"{name} of this model config")
    return entry.key, offsets, torch.empty(shape, dtype=meta.properties.dtype)


def read_regions(path: str | os.PathLike,
                 requests: dict[str, tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each destination with a region of a stored key: {name: (key, offsets, dest)}.

    Torch DCP's load with a planner that asks for regions (``create_read_items_for_chunk_list``
    finds the stored chunks that overlap each region): one layer of a stacked key is read
    without the others, in a 1-rank process, which dist_checkpointing.load cannot do there.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dcp.load({name: dest for name, (_, _, dest) in requests.items()},
             storage_reader=FileSystemReader(str(path)), planner=_region_planner()(requests),
             no_dist=True)


@functools.lru_cache(maxsize=None)
def _region_planner():
    """The planner class, defined once: a class built per call (closing over the requests) sits
    in a reference cycle and kept every part's tensors alive until the cyclic GC ran."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        def __init__(self, requests):
            super().__init__()
            self.requests = requests

        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, (key, offsets, dest) in self.requests.items():
                chunk = ChunkStorageMetadata(torch.Size(offsets), dest.shape)
                for it in create_read_items_for_chunk_list(
                        key, self.metadata.state_dict_metadata[key], [chunk]):
                    # destination named by the Megatron name: several layers of one key differ
                    items.append(dataclasses.replace(
                        it, dest_index=dataclasses.replace(it.dest_index, fqn=name)))
            return LoadPlan(items)

        def lookup_tensor(self, index) -> torch.Tensor:
            return self.requests[index.fqn][2]

    return RegionPlanner


def _nbytes(entry) -> int:
    return entry.data.numel() * entry.data.element_size()


# ----------------------------------------------------------------------------- trainer loading
def load_policy(path: str | os.PathLike, layout: ParallelLayout, *, ddp: bool = True,
                optimizer=None, seed: int = 1234, recompute: Optional[str] = None):
    """Build the model for ``layout`` and load an HF directory or a converted checkpoint into it.

    Collective over the world (every rank calls it). The layout is checked against the model
    before anything is built or read (InvalidLayoutError). Returns runtime.build.ModelOnLayout
    (``build_on_layout`` with a loader); its ``cfg`` is the ModelConfig read from ``path``.
    """
    from earl_megatron.runtime.build import build_on_layout

    cfg = read_model_config(path)
    layout.check(dist.get_world_size(), cfg)
    if is_mcore_checkpoint(path):
        def load(model, coords):
            load_mcore_into(model, path)
    else:
        ckpt = HFCheckpoint(path)

        def load(model, coords):
            load_hf_into(model, ckpt, cfg, layout, coords)
    return build_on_layout(cfg, layout, load=load, ddp=ddp, optimizer=optimizer, seed=seed,
                           recompute=recompute)


def load_mcore_into(model, path: str | os.PathLike) -> None:
    """dist_checkpointing.load into a bare GPTModel pp_stage (resharding to its layout)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    model.load_state_dict(loaded, strict=True)


def load_hf_into(model, ckpt: HFCheckpoint, cfg: ModelConfig, layout: ParallelLayout,
                 coords) -> None:
    """Read only this rank's shard of each of its parameters from HF shards (row/col ranges)."""
    from earl_megatron.plan.tensor_table import tensor_table

    ckpt.check_against(hfm.hf_shapes(cfg))
    table = tensor_table(cfg)
    for lname, p in model.named_parameters():
        rule = table.source_of(lname, coords.pp, layout.pp)   # KeyError names unknown tensors
        parts = [ckpt.read(s) for s in hfm.sources(rule, cfg, coords.tp, layout.tp)]
        t = hfm.combine(rule, cfg, parts)
        if t.shape != p.shape:
            raise ValueError(f"{lname}: HF shard {tuple(t.shape)} != parameter {tuple(p.shape)} "
                             f"(tp={layout.tp})")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
