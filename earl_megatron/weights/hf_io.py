"""Streaming reads and writes of Hugging Face safetensors directories, one tensor at a time.

Reading (``HFCheckpoint``): a directory with ``config.json`` and either ``model.safetensors`` or
shards listed in ``model.safetensors.index.json``. Opening it reads only the JSON headers and
checks them, so that a broken checkpoint fails before any conversion work:

- a shard named by the index that does not exist -> ``HFCheckpointError`` naming shard and index;
- a shard shorter than its header says (an interrupted download) -> ``HFCheckpointError`` with the
  expected and actual byte counts;
- an expected tensor absent from the index/headers, or a shape that does not match config.json
  -> ``HFCheckpointError`` naming the tensor (``check_against``).

Qwen3-MoE experts are read per expert (``model.layers.i.mlp.experts.e.{gate,up,down}_proj``:
the hub's format, and what transformers 5's ``save_pretrained`` writes); a directory holding
them fused (``mlp.experts.gate_up_proj`` [E, 2I, H]) is refused naming the fix.

Tensors are read with ``safetensors.safe_open`` one at a time (``read``), optionally only a row
or column range (``SourceSlice``), and each file handle is closed after the read: a kept-open
handle keeps the file's mmap pages resident, which would grow the RSS to the model size.

Writing (``HFWriter``): ``add(name, tensor)`` buffers tensors until a shard reaches
``max_shard_bytes`` and then writes it, so memory stays below one shard plus one tensor;
``finish`` names shards ``model-0000i-of-0000n.safetensors`` (or ``model.safetensors`` when
there is one), writes the index, config.json and copies tokenizer files.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from earl_megatron.runtime.io_errors import CheckpointError
from earl_megatron.weights.hf_mapping import SourceSlice

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


class HFCheckpointError(CheckpointError):
    """A checkpoint directory that cannot be read as it claims to be."""


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file, checked against the file's length."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise HFCheckpointError(f"{path}: {size} bytes, too short to be a safetensors file "
                                    "(truncated download?); fetch the file again")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise HFCheckpointError(f"{path}: header of {n} bytes but the file has {size} bytes: "
                                    "the file is truncated; fetch it again")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise HFCheckpointError(
            f"{path}: truncated shard: its header describes {8 + n + end} bytes but the file has "
            f"{size} bytes ({8 + n + end - size} missing); fetch the file again")
    return header


class HFCheckpoint:
    """An HF model directory opened for streaming reads (headers checked on open)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise HFCheckpointError(f"{self.path} has no config.json; is it a Hugging Face model "
                                    "directory?")
        self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        self.files: dict[str, str] = {}
        """tensor name -> shard file name."""
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            shard_names = sorted(set(weight_map.values()))
            missing = [s for s in shard_names if not (self.path / s).is_file()]
            if missing:
                raise HFCheckpointError(f"{index} lists shard(s) {missing} that do not exist in "
                                        f"{self.path}; download the missing files")
            self.files = dict(weight_map)
        elif (self.path / SINGLE).is_file():
            shard_names = [SINGLE]
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            if len(found) != 1:
                raise HFCheckpointError(
                    f"{self.path} has neither {INDEX} nor {SINGLE}"
                    + (f" but several .safetensors files {found}" if found else
                       " nor any .safetensors file (.bin checkpoints are not supported: "
                       "re-save with safe_serialization=True)"))
            shard_names = found
        self.meta: dict[str, dict[str, Any]] = {}
        """tensor name -> {"dtype", "shape", "data_offsets"} from the shard headers."""
        indexed = bool(self.files)
        for s in shard_names:
            header = read_header(self.path / s)
            for name, m in header.items():
                if indexed and self.files.get(name) != s:
                    continue  # with an index, the index alone says where a tensor lives
                self.files[name] = s
                self.meta[name] = m
        not_in_shard = [n for n in self.files if n not in self.meta]
        if not_in_shard:
            raise HFCheckpointError(f"{INDEX} maps {not_in_shard[:3]} to shards whose headers lack "
                                    "them; the index and shards are from different downloads")

    def names(self) -> list[str]:
        return sorted(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta(name)["shape"])

    def nbytes(self, name: str) -> int:
        a, b = self._meta(name)["data_offsets"]
        return b - a

    def total_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self.files)

    def _meta(self, name: str) -> dict[str, Any]:
        if name not in self.meta:
            if ".mlp.experts." in name and any(n.endswith(".mlp.experts.gate_up_proj")
                                               for n in self.meta):
                raise HFCheckpointError(
                    f"{self.path} stores experts fused (mlp.experts.gate_up_proj / down_proj, "
                    "transformers' in-memory layout) but the converter reads the hub's "
                    f"per-expert tensors ({name}); load it with transformers and save it again "
                    "with save_pretrained, which writes them per expert")
            where = INDEX if (self.path / INDEX).is_file() else "the safetensors header"
            raise HFCheckpointError(f"tensor {name!r} is missing from {where} in {self.path}; the "
                                    "checkpoint is incomplete or not of the architecture "
                                    "config.json names")
        return self.meta[name]

    def check_against(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected tensor exists with the expected shape (from the config); else raise."""
        for name, shape in expected.items():
            got = self.shape(name)
            if got != tuple(shape):
                raise HFCheckpointError(
                    f"tensor {name!r} in {self.files[name]} has shape {got} but config.json "
                    f"implies {tuple(shape)}; the weights and config.json do not belong together")

    def read(self, src: SourceSlice | str) -> torch.Tensor:
        """One tensor (or its row/column range) as a fresh CPU tensor; the file is closed after."""
        if isinstance(src, str):
            src = SourceSlice(src, None)
        self._meta(src.hf_name)
        with safe_open(self.path / self.files[src.hf_name], framework="pt") as f:
            if src.dim is None:
                return f.get_tensor(src.hf_name)
            sl = f.get_slice(src.hf_name)
            if src.dim == 0:
                return sl[src.start:src.stop].contiguous()
            if src.dim == 1:
                return sl[:, src.start:src.stop].contiguous()
            raise ValueError(f"slices along dim {src.dim} are not supported")

    def tokenizer_files(self) -> list[Path]:
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).is_file()]


def tokenizer_copies(default_dir: Path, tokenizer_from=None) -> tuple[Path, list[Path]]:
    """(the folder an export copies tokenizer files from, those files): ``--tokenizer-from``
    when given (it must be a folder), else ``default_dir`` (a checkpoint's hf/, possibly
    absent: nothing to copy); config.json is the export's own."""
    extra = Path(tokenizer_from) if tokenizer_from else Path(default_dir)
    if tokenizer_from and not extra.is_dir():
        raise CheckpointError(f"--tokenizer-from {extra} is not a folder; pass the folder that "
                              "holds tokenizer.json / tokenizer_config.json")
    return extra, [p for p in extra.iterdir() if p.is_file() and p.name != "config.json"] \
        if extra.is_dir() else []


class HFWriter:
    """Writes an HF directory shard by shard (``add`` ... ``finish``)."""

    def __init__(self, out_dir: str | os.PathLike, *, max_shard_bytes: int = 2 << 30):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        leftovers = [p.name for p in self.out.glob("*.safetensors")] + \
            ([INDEX] if (self.out / INDEX).exists() else [])
        if leftovers:
            raise FileExistsError(f"{self.out} already holds {leftovers[:3]}; choose an empty "
                                  "output directory")
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        tmp = f"part-{len(self._shards):05d}.safetensors.tmp"
        save_file(self._pending, str(self.out / tmp), metadata={"format": "pt"})
        self._shards.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0
        release_freed_memory()

    def finish(self, config: dict[str, Any], copy_from: Iterable[Path] = ()) -> list[str]:
        """Write the last shard, the index (when sharded), config.json and copied files."""
        self._flush()
        n = len(self._shards)
        final = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                         for i in range(n)]
        weight_map = {}
        for (tmp, names), name in zip(self._shards, final):
            os.replace(self.out / tmp, self.out / name)
            weight_map.update({t: name for t in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (self.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for src in copy_from:
            shutil.copy2(src, self.out / Path(src).name)
        return final


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Tensors of a few MB come from glibc's heap once its dynamic mmap threshold has risen; freed,
    they stay mapped. Without this, converting a 192 MiB model in 9 parts grew RSS by 165 MiB;
    with it, by ~40 MiB (HF -> Megatron-Core) and ~60-90 MiB (back, with 32 MiB HF shards).
    """
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def write_hf_dir(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor],
                 config: dict[str, Any], *, max_shard_bytes: int = 2 << 30,
                 copy_from: Iterable[Path] = ()) -> list[str]:
    """Write an in-memory state dict as an HF directory (tests, small models)."""
    w = HFWriter(out_dir, max_shard_bytes=max_shard_bytes)
    for name, t in tensors.items():
        w.add(name, t)
    return w.finish(config, copy_from)
