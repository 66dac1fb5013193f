"""Checkpoint-part surgery on torch distributed-checkpoint (DCP) files, below dist_checkpointing.

Two operations Megatron-Core's ``dist_checkpointing`` does not offer in a one-rank process:

- ``part_state_dict`` + ``merge_parts``: a checkpoint written as several independent saves
  ("parts", each holding some tensors and, of a stacked ``decoder.layers.*`` key, a contiguous
  layer range) becomes ONE checkpoint: the parts' ``.distcp`` files move into the output folder
  (renamed ``__partKKKKK<name>``) and their DCP ``.metadata`` are merged (chunk lists per key
  shifted to the part's first layer, storage index following the renamed files), as
  Megatron-Core's own ``remove_sharded_tensors`` rewrites that file.
- ``region_request`` + ``read_regions``: read regions of stored keys (one layer of a stacked key)
  without reading the rest, with a DCP load planner that asks only for those regions;
  ``read_groups`` streams groups of regions (a linear's weight with its LoRA adapter) in parts
  of a byte budget.

Stacked keys: Megatron stores ``decoder.layers.*`` tensors under one key with a leading layer axis
(num_layers, ...), and an MoE expert's fc1 / fc2 under one key with two leading axes
(num_layers, num_experts, ...) (SequentialMLP's sharded_state_dict; global expert index, so the
same key holds under any ep). ``stack_index(name)`` is a tensor's index along those axes. A part
must hold, of every stacked key, a box of indices (a contiguous layer range, and for experts a
contiguous expert range that is the same for each of its layers): ``box_broken_by`` and
``closes_boxes`` tell the writer where a part may end (weights/convert.py), so a part can exceed
its byte budget by at most one layer's experts.

Invariants: a merged checkpoint is byte-for-byte the parts' data (no tensor is rewritten), and
``dist_checkpointing.load`` reads it under any layout; a region read returns exactly the stored
values of that region. Errors reading damaged files are the caller's to translate
(weights/convert.py turns them into one-line CheckpointErrors).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch


_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.")
Index = tuple[int, ...]


def layer_of(name: str) -> Optional[int]:
    """The global layer index of a ``decoder.layers.<i>.*`` name (None for other tensors)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else None


def stack_index(name: str) -> Index:
    """A full-model tensor name's index along its key's stacked axes: (layer, expert) for an
    expert's tensor, (layer,) for another ``decoder.layers.*`` tensor, () otherwise."""
    m = _EXPERT.match(name)
    if m:
        return int(m.group(1)), int(m.group(2))
    layer = layer_of(name)
    return () if layer is None else (layer,)


def _ranges(indices: list[Index]) -> tuple[tuple[int, int], ...]:
    return tuple((min(i[d] for i in indices), max(i[d] for i in indices) + 1)
                 for d in range(len(indices[0])))


def _is_box(indices: list[Index]) -> bool:
    """The indices are exactly a product of ranges, each once."""
    n = 1
    for a, b in _ranges(indices):
        n *= b - a
    return len(set(indices)) == len(indices) == n


def _stacked(pending: dict) -> dict[str, list[Index]]:
    by_key: dict[str, list[Index]] = {}
    for key, index, _ in pending.values():
        if index:
            by_key.setdefault(key, []).append(index)
    return by_key


def box_broken_by(pending: dict, key: str, index: Index) -> bool:
    """Whether adding ``index`` of ``key`` (in model order: layers ascending, experts ascending
    within a layer) leaves that key's indices no way to become a box: a part that began in the
    middle of a layer's experts reaching the next layer. The writer ends the part first."""
    held = _stacked(pending).get(key)
    if len(index) < 2 or not held:
        return False
    first = min(held)
    return index[0] > first[0] and first[1] != 0


def closes_boxes(pending: dict) -> bool:
    """Whether the part may end here: every stacked key's indices are a box."""
    return all(_is_box(ix) for ix in _stacked(pending).values())


def part_state_dict(pending: dict[str, tuple[str, Index, torch.Tensor]]
                     ) -> tuple[dict[str, Any], dict[str, Index]]:
    """One part's ShardedTensors, stacked keys cut to the part's own box of indices.

    A part holds layers [a, b) (and of an expert key experts [e0, e1) of each) of a stacked key.
    It is saved as a (b - a, [e1 - e0,] ...) tensor because in a 1-rank world Megatron-Core's
    save cannot describe chunks that no rank holds; ``merge_parts`` shifts the chunks by
    ``(a[, e0])`` (returned per key) into the full (num_layers, [num_experts,] ...) tensor. Plain
    chunks replace the SwiGLU factory: the stored global tensor [gate; up] is the same and
    resharding on load reads any chunking.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    by_key = _stacked(pending)
    shift, sizes = {}, {}
    for key, indices in by_key.items():
        if not _is_box(indices):
            raise AssertionError(f"{key}: indices {sorted(indices)} of one part are not a box "
                                 "(contiguous layers, the same experts in each)")
        ranges = _ranges(indices)
        shift[key] = tuple(a for a, _ in ranges)
        sizes[key] = tuple(b - a for a, b in ranges)
    sd = {}
    for name, (key, index, t) in pending.items():
        if not index:
            sd[name] = ShardedTensor.from_rank_offsets(key, t, replica_id=0)
        else:
            axes = [(d, i - a, n) for d, (i, a, n) in
                    enumerate(zip(index, shift[key], sizes[key]))]
            sd[name] = ShardedTensor.from_rank_offsets(key, t, *axes, replica_id=0,
                                                       prepend_axis_num=len(index))
    return sd, shift


def merge_parts(part_dirs: list[Path], shifts: list[dict[str, Index]], num_layers: int,
                out: Path, num_experts: Optional[int] = None) -> None:
    """Merge the parts' torch_dist checkpoints into one (files moved, DCP .metadata rewritten).

    Part k's chunks of a stacked key move by ``shifts[k][key]`` along its leading axes and the
    key's size becomes (num_layers, [num_experts,] ...); every chunk's storage entry follows its
    file's new name.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorStorageMetadata)

    leading = (num_layers, num_experts)

    def moved(offsets, by: Index) -> torch.Size:
        return torch.Size((*(o + b for o, b in zip(offsets, by)), *offsets[len(by):]))

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
                size = m.size if by is None else torch.Size((*leading[:len(by)],
                                                              *m.size[len(by):]))
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


Region = tuple[str, tuple[int, ...]]
"""(checkpoint key, the tensor's shape without the stacked axes): one tensor ``read_groups``
reads (a template entry's ``key`` and ``data.shape``, or an adapter's key and table shape)."""


def region_request(region: Region, name: str, stored: dict, src: Path):
    """(checkpoint key, offsets, empty destination) for one Megatron tensor (layer i of a
    stacked key is the (1, ...) region at offset i; expert e of layer i the (1, 1, ...) region
    at (i, e))."""
    key, shape = region
    if key not in stored:
        raise KeyError(f"{src} has no tensor {key!r}; it was not written for this model "
                       "config (earl_model_config.json)")
    meta = stored[key]
    index = stack_index(name)
    offsets, shape = index + (0,) * len(shape), (1,) * len(index) + tuple(shape)
    if any(o + n > m for o, n, m in zip(offsets, shape, meta.size)):
        raise ValueError(f"{src}: {key} has shape {tuple(meta.size)}, too small for "
                         f"{name} of this model config")
    return key, offsets, torch.empty(shape, dtype=meta.properties.dtype)


def read_groups(src: Path, stored: dict, groups: list[dict[str, Region]], part_bytes: int
                ) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Read each group of regions ({name: region}, in order) and yield them part by part: a
    list of {name: tensor}, one per group, for every DCP read of about ``part_bytes``. A group
    is never split (a merged linear needs its weight and its adapter at once), and only one
    part's regions are allocated at a time."""
    i = 0
    while i < len(groups):
        batch, size = [], 0
        while i < len(groups) and (not batch or size < part_bytes):
            batch.append(groups[i])
            size += sum(region_bytes(r, stored) for r in groups[i].values())
            i += 1
        requests = {n: region_request(r, n, stored, src) for g in batch for n, r in g.items()}
        read_regions(src, requests)
        yield [{n: requests[n][2][(0,) * len(stack_index(n))] for n in g} for g in batch]
        del requests


def region_bytes(region: Region, stored: dict) -> int:
    """Bytes of one region as stored (0 for a key the checkpoint lacks: region_request names
    it)."""
    n = stored[region[0]].properties.dtype.itemsize if region[0] in stored else 0
    for s in region[1]:
        n *= s
    return n


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
