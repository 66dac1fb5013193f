"""Run Megatron-Core on CPU under gloo: an explicit, scoped redirection of its CUDA uses.

Megatron-Core 0.16 hard-codes CUDA in a handful of places that are incidental to the math
(see ../shared/DESIGN.md, "Measured here"): ``torch.zeros(..., device="cuda")`` in the pipeline
schedules, the causal mask and GlobalMemoryBuffer, ``inv_freq.to(torch.cuda.current_device())``
in rotary embeddings, p2p receive buffers, DDP grad buffers, the optimizer and grad clipping,
``pin_memory=True`` in rope utilities, ``param.grad.type() == 'torch.cuda.FloatTensor'`` asserts,
and the CUDA RNG tracker. ``cpu_backend()`` covers all of them:

- a ``TorchFunctionMode`` that rewrites CUDA device arguments (``"cuda"``, ``"cuda:N"``, bare
  ints, ``torch.device("cuda")``) to CPU, turns ``Tensor.cuda()`` into a no-op, drops
  ``pin_memory=True``, and answers ``Tensor.type()`` with the CUDA type name of the same dtype
  (only the no-argument form, which is what the asserts call);
- ``torch.cuda`` entry points Megatron calls unconditionally (current_device, synchronize,
  streams, events, memory queries, manual_seed) answered as a single "device 0" host;
- a CPU RNG tracker installed in place of Megatron's CUDA one, so ``fork()`` swaps CPU generator
  states and TP-split init stays reproducible;
- mixture of experts: the all-to-all token dispatcher keeps its split sizes as host numpy arrays
  (what ``maybe_move_tensor_to_cpu`` returns for a CUDA tensor; for a CPU tensor it returns the
  tensor, which gloo's ``all_to_all_single`` rejects as split sizes), and the all-to-all's
  backward runs inside the mode (autograd calls a custom Function's backward with no torch
  function mode active, and ``_AllToAll`` allocates its output on ``current_device()``; so do
  the sequence-parallel gathers / reduce-scatters and linear layers that MoE with tp > 1 trains
  through: every autograd Function of ``tensor_parallel.mappings`` and ``.layers``); with
  expert TP > 1 the dispatcher all-gathers / reduce-scatters tokens over the expert-TP group in
  uneven splits, which gloo refuses (it has no all-gather-v or reduce-scatter-v: "invalid tensor
  size"), so Megatron's two helpers run uneven splits as even collectives of the largest split,
  zero-padded, and cut the padding off (the same sums; equal splits go to Megatron's own code);
- activation recomputation (``tensor_parallel.checkpoint``, full and selective): its
  ``CheckpointFunction`` saves and restores the CPU generator, the tracker's states and the
  "CUDA" generator; on a host the CPU generator IS the device's, so the CUDA state is an empty
  tensor and setting it a no-op, and the recomputing backward runs inside the mode (as above).

``unredirected()`` scopes a hot region (the embedded engine's whole generate call) out of the
mode.

Invariants: nothing happens at import time; ``cpu_backend()`` is a context manager that restores
every patched attribute on exit; ``enable_cpu_backend()`` refuses to run when CUDA is available
(on GPUs the same code runs unmodified on NCCL); entering it twice is a no-op.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False


def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


_CUDA_TYPE = {
    torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor", torch.bool: "torch.cuda.BoolTensor",
    torch.int8: "torch.cuda.CharTensor", torch.int16: "torch.cuda.ShortTensor",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of any torch function to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE.get(args[0].dtype, func(*args))
        if func in (torch.Tensor.pin_memory,):
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to or func is torch.Tensor.new_empty or func is torch.Tensor.new_zeros:
            args = tuple("cpu" if (i == 1 and _is_cuda_device(a)) else a
                         for i, a in enumerate(args))
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Megatron's RNG tracker API over CPU generator states (used by TP-split init, dropout)."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return self._initialized

    def reset(self) -> None:
        self._initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict) -> None:
        self._initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        self._initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator().manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"cuda rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class _HostStream:
    """Stands for a CUDA stream on a host: work is already ordered, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _HostEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _HostEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``maybe_move_tensor_to_cpu`` for tensors already on the host: numpy when asked for."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _on_host(backward):
    """A custom autograd Function's backward run inside the mode (autograd calls it with no
    torch function mode active)."""
    def backward_on_host(ctx, *grad_output):
        with _CudaToCpuMode():
            return backward(ctx, *grad_output)
    return staticmethod(backward_on_host)


def _recompute_patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, CPU value) for activation recomputation's sites."""
    from megatron.core.tensor_parallel import random as mrandom

    return [(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8)),
            (mrandom, "_set_cuda_rng_state", lambda *a, **k: None),
            (mrandom.CheckpointFunction, "backward",
             _on_host(mrandom.CheckpointFunction.backward))]


def _moe_patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, CPU value) for the MoE sites above."""
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer.moe import token_dispatcher

    # every tensor-parallel autograd Function (the all-to-all, and the sequence-parallel
    # gathers / reduce-scatters and linear layers): their backwards allocate on current_device()
    functions = [f for mod in (mappings, layers) for f in vars(mod).values()
                 if isinstance(f, type) and issubclass(f, torch.autograd.Function)
                 and f.__module__ == mod.__name__ and "backward" in f.__dict__]

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_v(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        n, tail = max(output_split_sizes), tuple(input_.shape[1:])
        padded = input_.new_zeros((n, *tail))
        padded[:input_.shape[0]] = input_
        out = input_.new_empty((n * group.size(), *tail))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * n:i * n + s] for i, s in enumerate(output_split_sizes)])

    def reduce_scatter_v(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or len(set(input_split_sizes)) == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        n, tail = max(input_split_sizes), tuple(input_.shape[1:])
        stacked = input_.new_zeros((n * group.size(), *tail))
        for i, part in enumerate(torch.split(input_, list(input_split_sizes), dim=0)):
            stacked[i * n:i * n + part.shape[0]] = part
        out = input_.new_empty((n, *tail))
        torch.distributed.reduce_scatter_tensor(out, stacked, group=group)
        return out[:input_split_sizes[group.rank()]].clone()

    return [(token_dispatcher, "maybe_move_tensor_to_cpu", _host_splits),
            *[(f, "backward", _on_host(f.backward)) for f in functions],
            (mappings, "_gather_along_first_dim", gather_v),
            (mappings, "_reduce_scatter_along_first_dim", reduce_scatter_v)]


def _cuda_patches() -> dict[str, Any]:
    stream = _HostStream()
    return {
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "Stream": _HostStream,
        "Event": _HostEvent,
        "current_stream": lambda *a, **k: stream,
        "default_stream": lambda *a, **k: stream,
        "stream": lambda s=None: contextlib.nullcontext(),
        "memory_allocated": lambda *a, **k: 0,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "empty_cache": lambda: None,
        "nvtx": _Nvtx(),
    }


class _Nvtx:
    @staticmethod
    def range_push(*a, **k):
        pass

    @staticmethod
    def range_pop(*a, **k):
        pass

    @staticmethod
    @contextlib.contextmanager
    def range(*a, **k):
        yield


@contextlib.contextmanager
def cpu_backend() -> Iterator[None]:
    """Scope in which Megatron-Core's CUDA uses run on the CPU. Refuses to run with CUDA."""
    global _ACTIVE
    if _ACTIVE:
        yield
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_backend() is for CPU-only hosts; with CUDA available, run the "
                           "same code without it (NCCL backend, real CUDA devices)")
    from megatron.core.tensor_parallel import random as mrandom

    saved_cuda = {k: getattr(torch.cuda, k) for k in _cuda_patches() if hasattr(torch.cuda, k)}
    missing = [k for k in _cuda_patches() if not hasattr(torch.cuda, k)]
    saved_tracker = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    saved_tracker_cls = mrandom.CudaRNGStatesTracker
    moe = _moe_patches() + _recompute_patches()
    saved_moe = [(owner, name, owner.__dict__[name]) for owner, name, _ in moe]
    mode = _CudaToCpuMode()
    _ACTIVE = True
    try:
        for k, v in _cuda_patches().items():
            setattr(torch.cuda, k, v)
        for owner, name, value in moe:
            setattr(owner, name, value)
        # Megatron's initialize_rng_tracker() instantiates CudaRNGStatesTracker: route it here.
        mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        with mode:
            yield
    finally:
        _ACTIVE = False
        for k, v in saved_cuda.items():
            setattr(torch.cuda, k, v)
        for k in missing:
            if hasattr(torch.cuda, k):
                delattr(torch.cuda, k)
        for owner, name, value in saved_moe:
            setattr(owner, name, value)
        mrandom.CudaRNGStatesTracker = saved_tracker_cls
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker


def is_active() -> bool:
    return _ACTIVE


_CPU = torch.device("cpu")


@contextlib.contextmanager
def unredirected() -> Iterator[None]:
    """A hot region of known code run WITHOUT the torch-function mode (its Python dispatch on
    every torch call is a large share of a small model's decode step). Inside, nothing is
    rewritten except ``torch.cuda.current_device()``, which answers the CPU device itself, so
    Megatron's ``device=torch.cuda.current_device()`` allocations land on the host; any other
    CUDA use fails loudly ("Cannot access accelerator device"). Outside the backend: a no-op."""
    if not _ACTIVE:
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: _CPU
    try:
        with torch._C.DisableTorchFunction():
            yield
    finally:
        torch.cuda.current_device = saved
