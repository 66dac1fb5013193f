"""Silence what Megatron-Core (and torch under it) print on every import and build, and say
nothing actionable about a run; call ``quiet_known_warnings()`` at an entry point BEFORE the
imports that print them (train.py, tools/).

Invariants: only the messages listed here are filtered, each matched on its own text, so any
other warning (ours included) still shows; nothing happens at import time of this module
(STYLE.md lesson 9): the entry point calls the function.

What is filtered, and why it is safe to hide:
- "Transformer Engine and Apex are not installed ..." / "Apex is not installed ...": both are
  optional accelerators (DESIGN.md); Megatron falls back to torch norms and optimizers.
- "full scope is deprecated ... cuda_graph_scope": a TransformerConfig default of 0.16 itself.
- "CUDA_DEVICE_MAX_CONNECTIONS": a CUDA tuning hint Megatron also prints on CPU.
- "`torch.distributed.all_gather_into_tensor` is deprecated" (Megatron's own call) and "torch.
  distributed is disabled, unavailable or uninitialized" (torch DCP read in one process, which
  the conversion tools do on purpose).
- "`load_state_dict` is deprecated" / "deprecating ShardedTensor": torch's notices about the
  APIs Megatron 0.16's torch_dist checkpoint strategy calls on every load.
- Megatron-FSDP's INFO log lines ("Detected Megatron Core, using Megatron-FSDP ..."), printed at
  import through the root logger Hydra configures at INFO: the trainer never uses FSDP.
"""

from __future__ import annotations

import logging
import warnings

KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "`torch.distributed._all_gather_base` is deprecated",
    "`torch.distributed._reduce_scatter_base` is deprecated",
    "torch.distributed is disabled, unavailable or uninitialized",
    "`load_state_dict` is deprecated and will be removed",
    "Please use DTensor instead and we are deprecating ShardedTensor",
)

KNOWN_LOGGERS = ("megatron.core.distributed.fsdp",)


def quiet_known_warnings() -> None:
    """Install the filters (idempotent: warnings.filterwarnings de-duplicates)."""
    for text in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{_escape(text)}")
    for name in KNOWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _escape(text: str) -> str:
    import re
    return re.escape(text)
