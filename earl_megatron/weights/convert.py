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
                                   check: a part covers only some layers of a stacked key; an
                                   MoE part ends only where its experts form a box: dcp_parts)
    all parts --> move their .distcp files into the checkpoint and merge their DCP .metadata
                  (chunk lists per key, storage index with renamed files), as Megatron-Core's own
                  ``remove_sharded_tensors`` rewrites that file

Keys and shapes come from a GPTModel built on the meta device (no weights allocated). Converting
back reads up to ``part_bytes`` of layer regions at a time (``read_regions``: torch DCP's load with
a planner that asks for one layer of a stacked key) and streams HF shards out (hf_io.HFWriter).
A LoRA checkpoint goes out as a PEFT adapter, or with ``merged`` each adapted linear is read
with its adapter and merged (weights/peft_export.py).
Conversions run in one process on CPU. ``progress=True`` (the tools' default) shows the bytes
converted of the model's total: a rich bar on a terminal, a line per tenth otherwise, then
"done: N bytes" (earl_megatron/progress.py).

Invariant: HF -> Megatron-Core -> HF returns every tensor bit-exact (dtype kept, no casts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.progress import ByteProgress
from earl_megatron.runtime.checkpoint import CONFIG_JSON, HF_SUBDIR, save_sharded
from earl_megatron.weights import dcp_parts as dcp
from earl_megatron.weights import hf_mapping as hfm
from earl_megatron.weights import peft_export as peft
from earl_megatron.weights.peft_import import for_policy, is_peft_adapter, recorded_base
from earl_megatron.weights.hf_io import (HFCheckpoint, HFWriter, release_freed_memory,
                                        tokenizer_copies)
from earl_megatron.runtime.io_errors import CheckpointError, new_output_dir, reading


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
        f = p / CONFIG_JSON
        try:
            return ModelConfig(**json.loads(f.read_text()))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{f} is not a model config ({' '.join(str(e).split())}); "
                                  "copy the checkpoint again") from None
    if (p / "config.json").is_file():
        f = p / "config.json"
        try:
            hf = json.loads(f.read_text())
        except ValueError as e:
            raise CheckpointError(f"{f} is not valid JSON ({e}); copy the model again") from None
        return hfm.from_hf_config(hf)
    raise CheckpointError(f"{p} is neither a converted Megatron-Core checkpoint ({CONFIG_JSON} "
                          "+ metadata.json) nor a Hugging Face directory (config.json); check "
                          "the path")


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


# ----------------------------------------------------------------------------- HF -> Megatron
def convert_hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        part_bytes: int = 256 << 20, progress: bool = False) -> ConversionStats:
    """HF directory -> dist_checkpointing directory loadable under any layout (one process)."""

    t0 = time.perf_counter()
    cfg = read_model_config(hf_dir)  # an unsupported architecture fails before any file check
    ckpt = HFCheckpoint(hf_dir)
    ckpt.check_against(hfm.hf_shapes(cfg))
    with new_output_dir(out_dir, inputs=[hf_dir]) as out, reading(hf_dir, "HF model"):
        stats = _hf_to_mcore(ckpt, cfg, out, part_bytes, progress)
    return dataclasses.replace(stats, seconds=time.perf_counter() - t0)


def _hf_to_mcore(ckpt: HFCheckpoint, cfg: ModelConfig, out: Path, part_bytes: int,
                 progress: bool) -> ConversionStats:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tmp = out / ".parts"
    tmp.mkdir()
    rules = hfm.rules(cfg)
    total = sum(ckpt.nbytes(n) for r in rules for n in r.hf)
    done = n_tensors = 0
    part_dirs: list[Path] = []
    shifts: list[dict[str, int]] = []
    with conversion_process(cfg):
        template = sharded_template(cfg)
        objects = {k: v for k, v in template.items() if isinstance(v, ShardedObject)}
        pending: dict[str, tuple[str, dcp.Index, torch.Tensor]] = {}
        pending_bytes = 0

        def flush():
            nonlocal pending, pending_bytes, objects
            sd, shift = dcp.part_state_dict(pending)
            sd.update(objects)  # extra-state objects are bytes: any one part may hold them
            objects = {}
            d = tmp / f"part_{len(part_dirs):05d}"
            d.mkdir()
            save_sharded(sd, d, validate_access_integrity=False)
            part_dirs.append(d)
            shifts.append(shift)
            pending, pending_bytes = {}, 0
            del sd
            release_freed_memory()

        with ByteProgress("HF -> Megatron-Core", total, enabled=progress) as prog:
            for rule in rules:
                full = hfm.combine(rule, cfg, [ckpt.read(s) for s in hfm.sources(rule, cfg)])
                if rule.name not in template:
                    raise KeyError(f"{rule.name} is not in GPTModel.sharded_state_dict(); "
                                   "the Megatron-Core version renamed it: update hf_mapping")
                entry = template[rule.name]
                _check_shape(entry, full, rule.name)
                index = dcp.stack_index(rule.name)
                if dcp.box_broken_by(pending, entry.key, index):
                    flush()
                pending[rule.name] = (entry.key, index, full)
                nbytes = full.numel() * full.element_size()
                pending_bytes += nbytes
                done += nbytes
                n_tensors += 1
                prog.update(done)
                if pending_bytes >= part_bytes and dcp.closes_boxes(pending):
                    flush()
            if pending or objects:
                flush()
            prog.phase(f"merging {len(part_dirs)} part(s) into one checkpoint")
            dcp.merge_parts(part_dirs, shifts, cfg.num_layers, out, cfg.num_experts)
    shutil.rmtree(tmp)
    (out / CONFIG_JSON).write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    (out / HF_SUBDIR).mkdir()
    for src in [ckpt.path / "config.json"] + ckpt.tokenizer_files():
        shutil.copy2(src, out / HF_SUBDIR / src.name)
    return ConversionStats(n_tensors, done, 0.0, len(part_dirs))


# ----------------------------------------------------------------------------- Megatron -> HF
def convert_mcore_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        part_bytes: int = 256 << 20, max_shard_bytes: int = 2 << 30,
                        tokenizer_from: Optional[str | os.PathLike] = None,
                        progress: bool = False, merged: bool = False,
                        base_model: Optional[str] = None) -> ConversionStats:
    """Converted or training checkpoint -> HF directory (config.json, safetensors shards,
    tokenizer files). A LoRA checkpoint becomes a PEFT adapter (``adapter_model.safetensors``,
    ``adapter_config.json`` naming ``base_model`` or the run's recorded base, and the tokenizer
    files), or with ``merged`` a full HF model with the adapters merged (weights/peft_export)."""
    from torch.distributed.checkpoint import FileSystemReader

    t0 = time.perf_counter()
    src = Path(ckpt_dir)
    if not is_mcore_checkpoint(src):
        raise CheckpointError(f"{src} is not a converted checkpoint (no {CONFIG_JSON} or "
                              "metadata.json); convert it with tools/convert_hf_to_mcore.py")
    with reading(src):
        cfg = read_model_config(src)
        base_path = src / HF_SUBDIR / "config.json"
        base = json.loads(base_path.read_text()) if base_path.is_file() else None
        stored = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    if merged and not cfg.lora.enabled:
        raise CheckpointError(f"--merged merges LoRA adapters, and {src} has none "
                              "(model.lora.rank=0): drop --merged")
    extra, copy = tokenizer_copies(src / HF_SUBDIR, tokenizer_from)
    rules = hfm.rules(cfg)
    with conversion_process(cfg):
        template = sharded_template(cfg.base)
    adapters = peft.adapter_groups(cfg, template)
    # every key and shape checked against the model before anything is written
    for name, region in [(r.name, region_of(template[r.name])) for r in rules] + \
            [kv for g in adapters.values() for kv in g.items()]:
        dcp.region_request(region, name, stored, src)
    with new_output_dir(out_dir, inputs=[src] + ([extra] if tokenizer_from else [])) as out, \
            reading(src):
        if cfg.lora.enabled and not merged:
            n, nbytes, n_parts = peft.write_adapter(
                src, out, cfg, adapters, stored, base_model or recorded_base(src),
                part_bytes, progress)
            for f in copy:
                shutil.copy2(f, out / f.name)
            return ConversionStats(n, nbytes, time.perf_counter() - t0, n_parts)
        writer = HFWriter(out, max_shard_bytes=max_shard_bytes)
        n_parts = mcore_to_hf_parts(src, cfg, template, stored, writer, part_bytes, progress,
                                    adapters if merged else {})
        writer.finish(hfm.to_hf_config(cfg, base), copy)
    return ConversionStats(len(rules), writer.total_bytes, time.perf_counter() - t0, n_parts)


def mcore_to_hf_parts(src: Path, cfg: ModelConfig, template: dict, stored: dict,
                      writer: HFWriter, part_bytes: int, progress: bool, adapters: dict,
                      rules=None) -> int:
    """Stream the checkpoint's tensors out (``rules``, default all of ``cfg``'s), up to
    ``part_bytes`` of regions per read; each linear in ``adapters`` ({weight name: {A name:
    region, B name: region}}) is read with its adapter and written merged."""
    rules = hfm.rules(cfg) if rules is None else rules
    groups = [{r.name: region_of(template[r.name]), **adapters.get(r.name, {})} for r in rules]
    n_parts = done = 0
    # the bar counts the bytes written (a merged adapter's are read, not written)
    total = sum(dcp.region_bytes(g[r.name], stored) for r, g in zip(rules, groups))
    todo = iter(zip(rules, groups))
    with ByteProgress("Megatron-Core -> HF", total, enabled=progress) as prog:
        for part in dcp.read_groups(src, stored, groups, part_bytes):
            n_parts += 1
            for got in part:
                rule, group = next(todo)
                full = got[rule.name]
                if rule.name in adapters:
                    a, b = (got[n] for n in adapters[rule.name])
                    full = peft.merged(full, a, b, cfg.lora.scaling)
                for hf_name, t in hfm.split(rule, cfg, full).items():
                    writer.add(hf_name, t)
                done += dcp.region_bytes(group[rule.name], stored)
                prog.update(done)
            del part, got, full
            release_freed_memory()
    return n_parts


def region_of(entry) -> dcp.Region:   # the stored (key, global shape) a template entry reads
    return entry.key, tuple(entry.data.shape)


# ----------------------------------------------------------------------------- trainer loading
def _without_adapters(cfg: ModelConfig, path, what: str) -> ModelConfig:
    """``cfg``, refused when it has LoRA adapters: ``load_policy`` knows the base's tensors
    only and would drop the adapters without a word (issue #46)."""
    if cfg.lora.enabled:
        raise CheckpointError(f"{path} holds LoRA adapters (model.lora.rank={cfg.lora.rank}): "
                              f"{what} is not built yet for LoRA (issue #46); resume the run "
                              "from its run.output_dir, or export it merged (earl convert "
                              "mcore-to-hf --merged) and load that")
    return cfg


def load_policy(path: str | os.PathLike, layout: ParallelLayout, *, ddp: bool = True,
                optimizer=None, seed: int = 1234, recompute: Optional[str] = None,
                pools: Optional[tuple] = None, lora=None):
    """Build the model for ``layout`` and load an HF directory or a converted checkpoint into it.

    Collective over the world (every rank calls it). The layout is checked against the model
    before anything is built or read (InvalidLayoutError). Returns runtime.build.ModelOnLayout
    (``build_on_layout`` with a loader); its ``cfg`` is the ModelConfig read from ``path``.
    ``pools``: split placement's pools, as ``build_on_layout`` takes them (``layout`` is this
    rank's pool's). ``lora``: a LoraSpec with a rank: the checkpoint is the base, and fresh
    adapters from ``seed`` go over it (B zero: the checkpoint's outputs); the returned ``cfg``
    carries it. A PEFT adapter directory: its base, with its adapter (weights/peft_import.py).
    """
    from earl_megatron.runtime.build import build_on_layout

    path, lora, adapters = for_policy(path, lora, read_model_config) if is_peft_adapter(path) \
        else (path, lora, None)
    cfg = _without_adapters(read_model_config(path), path, "loading it as a policy")
    if lora is not None:
        cfg = cfg.with_(lora=lora)
    layout.check(layout.world_size if pools else dist.get_world_size(), cfg)
    what = "policy checkpoint" if is_mcore_checkpoint(path) else "HF model"
    if is_mcore_checkpoint(path):
        def load(model, coords):
            with reading(path, what):
                load_mcore_into(model, path)
    else:
        with reading(path, what):
            ckpt = HFCheckpoint(path)

        def load(model, coords):
            with reading(path, what):
                load_hf_into(model, ckpt, cfg, layout, coords)
    return build_on_layout(cfg, layout, load=load, ddp=ddp, optimizer=optimizer, seed=seed,
                           recompute=recompute, pools=pools, adapters=adapters)


def load_mcore_into(model, path: str | os.PathLike, skip: tuple[str, ...] = ()) -> None:
    """dist_checkpointing.load into a bare GPTModel pp_stage (resharding to its layout). A
    trainer's checkpoint also holds the optimizer and the run's state: only the model's keys
    are taken, every one required but those under a ``skip`` prefix, which are not read."""
    from megatron.core import dist_checkpointing

    want = {k: v for k, v in model.sharded_state_dict().items() if not k.startswith(skip)}
    loaded = dist_checkpointing.load(want, str(path))
    missing, _ = model.load_state_dict({k: v for k, v in loaded.items() if k in want},
                                       strict=not skip)
    if left := [k for k in missing if not k.startswith(skip)]:
        raise CheckpointError(f"{path} lacks the model's tensors {left[:3]}")


def join_policy_load(path: str | os.PathLike) -> None:
    """A rank that holds no part of the model (split placement's rollout pool, which gets the
    weights from the train pool) joins the collective read of ``load_policy`` on the others
    (a converted or trainer checkpoint: dist_checkpointing reads on every rank of the world);
    an HF directory is read per rank, so there is nothing to join."""
    from megatron.core import dist_checkpointing

    if is_mcore_checkpoint(path):
        with reading(path, "policy checkpoint"):
            dist_checkpointing.load({}, str(path))


def load_hf_into(model, ckpt: HFCheckpoint, cfg: ModelConfig, layout: ParallelLayout,
                 coords, expected: Optional[dict] = None) -> None:
    """Read only this rank's shard of each of its parameters from HF shards (row/col ranges);
    ``expected``: the HF tensors checked present (default: all of ``cfg``'s)."""
    from earl_megatron.plan.tensor_table import tensor_table

    ckpt.check_against(hfm.hf_shapes(cfg) if expected is None else expected)
    table = tensor_table(cfg)
    rank = layout.rank(coords)
    for lname, p in model.named_parameters():
        rule = table.source_on(lname, layout, rank)   # KeyError names unknown tensors
        # an expert's shard: its expert-TP rank of etp (the others: tp rank of tp)
        parts = [ckpt.read(s) for s in hfm.sources(rule, cfg, rule.tp_rank_of(layout, rank),
                                                   rule.tp_of(layout))]
        t = hfm.combine(rule, cfg, parts)
        if t.shape != p.shape:
            raise ValueError(f"{lname}: HF shard {tuple(t.shape)} != parameter {tuple(p.shape)} "
                             f"({layout})")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
