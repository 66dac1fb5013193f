"""Inputs of the layout selector: the cluster, one stage's workload, and the training options.

Three frozen values, pure Python (no torch): ``ClusterSpec`` (devices and links),
``StageWorkload`` (what one RL stage must process) and ``TrainOptions`` (optimizer, recompute,
dtypes). The model itself is ``earl_megatron.config.model.ModelConfig``; it is not duplicated.

Units are SI throughout: bytes, seconds, FLOP/s, bytes/s. Bandwidths are one direction.

Invariants:
- Every count is a positive int and every rate a positive float; constructors raise ValueError
  naming the field otherwise.
- ``StageWorkload.contexts`` is a histogram: ascending, distinct lengths, positive counts, and its
  counts sum to ``num_sequences``.
- Rank r lives on node ``r // devices_per_node`` (ranks of a node are consecutive, as torchrun
  assigns them), which with Megatron's rank order (tp fastest) keeps small TP groups in a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Iterable, Optional

from earl_megatron.plan.placement import ITEMSIZE
from earl_megatron.stages import Stage  # noqa: F401 - the planners' Stage (one definition)

GiB = 1024 ** 3
DTYPE_BYTES = {k: ITEMSIZE[k] for k in ("float32", "bfloat16", "float16")}
"""Bytes per element of the dtypes a model's parameters may have (sizes: placement.ITEMSIZE)."""


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB": messages stay readable from the tiny CPU model to a 72B model."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


class Recompute(Enum):
    """Megatron-Core activation recomputation (``recompute_granularity``)."""

    NONE = "none"
    SELECTIVE = "selective"
    """Recompute the attention core only (``recompute_modules=["core_attn"]``)."""
    FULL = "full"
    """Recompute each whole layer from its input (``recompute_method="uniform"``, 1 layer)."""


def _positive(obj, *names: str, kind=int) -> None:
    for name in names:
        v = getattr(obj, name)
        ok = (isinstance(v, int) and not isinstance(v, bool)) if kind is int else \
            isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok or v <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be a positive "
                             f"{'int' if kind is int else 'number'}, got {v!r}")


@dataclass(frozen=True)
class DecodeEngine:
    """What the rollout cost model needs to know about the engine that decodes (time_model.py).

    The constants are ASSUMPTIONS until a profile table calibrates them (docs/selector.md says
    which are measured): the profile table's measured/analytic factor absorbs their error.
    """

    name: str = "sglang"
    paged_kv: bool = True
    """True: a paged KV pool (SGLang, vLLM) sized by ``memory_fraction``; the running batch is
    what the pool holds and further sequences wait (throughput drops, nothing runs out of
    memory unless the weights or ONE sequence do not fit). False: a static cache reserved for
    every response at its longest context (the embedded engine's StaticInferenceContext)."""
    memory_fraction: float = 0.88
    """Fraction of device memory the engine takes for weights + KV pool (SGLang's
    ``--mem-fraction-static`` default is 0.88)."""
    step_overhead_s: float = 1e-3
    """Fixed seconds per decode step outside the GPU kernels (scheduler, sampling, launches)."""
    servers: bool = False
    """True: separate inference servers the trainer starts (``sglang_servers``): each holds its
    own copy of the weights (weights / tp, pp = 1) next to the trainer's, allocates its whole KV
    pool at start (static: ``memory_fraction`` x device memory minus everything already on the
    device, as SGLang's ``--mem-fraction-static`` sizes it) and restarts when the rollout tp or
    dp changes (the selector prices that: plan/server_restart.py). False: a pool or cache of
    the trainer's own model, sized by what the responses need."""
    beside_trainer: bool = True
    """Servers only: they share their devices with the trainer's model (colocated placement).
    False: their devices hold the servers alone (split placement's rollout pool,
    plan/split.py), so the pool is sized without the trainer's weights."""

    def __post_init__(self):
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"DecodeEngine.memory_fraction must be in (0, 1], got "
                             f"{self.memory_fraction}")
        if self.step_overhead_s < 0:
            raise ValueError(f"DecodeEngine.step_overhead_s must be >= 0, got "
                             f"{self.step_overhead_s}")

    @classmethod
    def sglang(cls) -> "DecodeEngine":
        """A generic SGLang-like paged pool (the presets' what-if planning)."""
        return cls()

    @classmethod
    def sglang_servers(cls, memory_fraction: float,
                       step_overhead_s: float = 1e-3) -> "DecodeEngine":
        """The SGLang servers the trainer starts (rollout.engine=sglang), with the
        ``--mem-fraction-static`` they are started with."""
        return cls(name="sglang", paged_kv=True, memory_fraction=memory_fraction,
                   step_overhead_s=step_overhead_s, servers=True)

    @classmethod
    def embedded(cls, step_overhead_s: float = 2e-3) -> "DecodeEngine":
        """The embedded Megatron-Core engine: a static KV cache, Python per step."""
        return cls(name="embedded", paged_kv=False, memory_fraction=1.0,
                   step_overhead_s=step_overhead_s)


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``nodes`` x ``devices_per_node`` ranks."""

    nodes: int
    devices_per_node: int
    device_memory_bytes: int
    """Memory one rank may use (HBM on a GPU; the per-rank budget on CPU)."""
    peak_flops: float
    """Dense bf16 FLOP/s of one device (fp32 on CPU)."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s: bounds decoding, which reads all weights per token."""
    intra_node_bandwidth: float
    """Bytes/s one device can send to another in its node (NVLink: 450e9 on H100 SXM)."""
    inter_node_bandwidth: float
    """Bytes/s one NODE can send to other nodes (all its NICs together); groups that cross
    nodes at the same time share it. The one unit of inter-node bandwidth in the project: the
    dispatch simulator (dispatch_sim.py) divides it among a node's ranks the same way."""
    achievable_flops_fraction: float = 0.45
    """Fraction of peak a large GEMM-dominated step reaches (MFU); the profile table corrects it."""
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    fused_attention: bool = True
    """A fused (flash) attention kernel that never stores the s x s scores. False on CPU, where
    Megatron's unfused DotProductAttention materialises them."""
    reserved_bytes: int = 0
    """Per-rank memory the runtime takes before the model (CUDA context, NCCL, allocator slack)."""
    regroup_seconds: float = 0.05
    """Fixed cost of rebuilding process groups at a layout switch (measured 40-70 ms on CPU)."""
    decode_engine: DecodeEngine = DecodeEngine()
    """The rollout engine the ROLLOUT stage is priced for (SGLang-like by default)."""
    name: str = "custom"

    def __post_init__(self):
        _positive(self, "nodes", "devices_per_node", "device_memory_bytes")
        _positive(self, "peak_flops", "hbm_bandwidth", "intra_node_bandwidth",
                  "inter_node_bandwidth", "regroup_seconds", kind=float)
        if not 0 < self.achievable_flops_fraction <= 1:
            raise ValueError(f"achievable_flops_fraction must be in (0, 1], "
                             f"got {self.achievable_flops_fraction}")
        if self.reserved_bytes < 0 or self.reserved_bytes >= self.device_memory_bytes:
            raise ValueError(f"reserved_bytes={self.reserved_bytes} must be in "
                             f"[0, device_memory_bytes={self.device_memory_bytes})")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.achievable_flops_fraction

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def with_(self, **changes) -> "ClusterSpec":
        return replace(self, **changes)

    @classmethod
    def h100_80gb(cls, nodes: int = 1, inter_node_gbps: float = 200.0,
                  devices_per_node: int = 8) -> "ClusterSpec":
        """H100-80GB SXM, 8 per node unless told. Datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s
        HBM3, NVLink 4 at 450 GB/s per direction; ``inter_node_gbps`` is the node's network in
        Gbit/s."""
        return cls(nodes=nodes, devices_per_node=devices_per_node,
                   device_memory_bytes=80 * 10 ** 9,
                   peak_flops=989e12, hbm_bandwidth=3.35e12, intra_node_bandwidth=450e9,
                   inter_node_bandwidth=inter_node_gbps * 1e9 / 8,
                   achievable_flops_fraction=0.45, intra_node_latency_s=1e-6,
                   inter_node_latency_s=5e-6, fused_attention=True, reserved_bytes=3 * GiB,
                   regroup_seconds=0.5, decode_engine=DecodeEngine.sglang(),
                   name=f"{nodes}x{devices_per_node} H100-80GB, {inter_node_gbps:g} Gbps")

    @classmethod
    def cpu(cls, ranks: int = 4, memory_budget_bytes: int = 2 * GiB, cores: int = 2,
            core_flops: float = 35e9) -> "ClusterSpec":
        """This development machine: ``ranks`` gloo processes sharing ``cores`` CPU cores.

        Ranks beyond the core count time-share, so each gets ``cores / ranks`` of a core's
        ``core_flops`` (an fp32 matmul on one thread measured 34-36 GFLOP/s here, 2026-11, on a
        busy machine). Memory and gloo loopback rates are nominal (~10 and ~1.5 GB/s); the
        profile table corrects all of them. The per-rank memory is a budget we choose.
        """
        share = min(1.0, cores / ranks)
        return cls(nodes=1, devices_per_node=ranks, device_memory_bytes=memory_budget_bytes,
                   peak_flops=core_flops * share, hbm_bandwidth=10e9 * share,
                   intra_node_bandwidth=1.5e9, inter_node_bandwidth=1.5e9,
                   achievable_flops_fraction=0.3, intra_node_latency_s=50e-6,
                   inter_node_latency_s=50e-6, fused_attention=False, reserved_bytes=0,
                   regroup_seconds=0.055, decode_engine=DecodeEngine.embedded(),
                   name=f"cpu {ranks} ranks on {cores} cores")


CLUSTER_PRESETS = ("cpu", "h100")


def cluster_spec(preset: str, *, nodes: int, devices_per_node: int,
                 inter_node_gbps: Optional[float] = None,
                 device_memory_bytes: Optional[int] = None) -> ClusterSpec:
    """The one mapping from a cluster description (the trainer's ``cluster.*`` keys,
    ``tools/plan_layouts.py``'s flags, the benchmarks) to the ``ClusterSpec`` the selector plans
    on: ``nodes`` x ``devices_per_node`` ranks, as torchrun started them.

    - "h100": H100-80GB nodes of ``devices_per_node`` devices (a 1-node, 4-GPU job plans 4-rank
      layouts); ``device_memory_bytes`` replaces the 80 GB when given (a budget below it).
    - "cpu": this machine, every rank on its cores (emulated nodes share one host, so the cpu
      preset is one node of all ranks); ``device_memory_bytes`` is the per-rank budget
      (default 2 GiB).
    """
    if preset not in CLUSTER_PRESETS:
        raise ValueError(f"cluster preset {preset!r}: use one of {list(CLUSTER_PRESETS)}")
    if preset == "cpu":
        return ClusterSpec.cpu(ranks=nodes * devices_per_node,
                               memory_budget_bytes=device_memory_bytes or 2 * GiB)
    spec = ClusterSpec.h100_80gb(nodes=nodes, devices_per_node=devices_per_node,
                                 **({} if inter_node_gbps is None
                                    else {"inter_node_gbps": inter_node_gbps}))
    return spec.with_(device_memory_bytes=device_memory_bytes) if device_memory_bytes else spec


PREFILL_TOKENS = 8192
"""Tokens of one prefill forward of the embedded engine (rows = this // width), and the default
micro-batch budget the memory model plans every stage with."""


@dataclass(frozen=True)
class StageWorkload:
    """What one stage must process in one RL iteration (globally, over all dp replicas)."""

    stage: Stage
    contexts: tuple[tuple[int, int], ...]
    """Histogram of sequence lengths in tokens: ((length, count), ...) ascending."""
    responses_in_flight: int = 1
    """ROLLOUT: responses submitted at once IN TOTAL, over all rollout replicas; each replica
    gets ``responses_per_replica(dp)`` of them (the trainer passes its episodes per iteration).
    How many of those a replica decodes concurrently is the engine's KV pool's business (the
    running batch, time_model.py). Ignored by LOGPROB and TRAIN."""
    micro_batch_tokens: int = PREFILL_TOKENS
    """Token budget of one packed micro-batch per dp replica. A sequence is never split across
    micro-batches, so a micro-batch holds at least one whole sequence. ROLLOUT: the prefill
    chunk (the embedded engine's ``prefill_tokens``, this same default)."""
    predicted_context: int = 0
    """Plan memory for contexts up to this length even if none is that long yet (growth)."""
    decode_fraction: float = 0.25
    """ROLLOUT: fraction of each context generated token by token; the rest (prompt, environment
    and tool observations) is prefilled."""

    def __post_init__(self):
        if not isinstance(self.stage, Stage):
            raise ValueError(f"stage must be a Stage, got {self.stage!r}")
        if not self.contexts:
            raise ValueError("StageWorkload.contexts is empty: give at least one (length, count)")
        prev = 0
        for length, count in self.contexts:
            ints = isinstance(length, int) and isinstance(count, int)
            if not ints or length <= 0 or count <= 0:
                raise ValueError(f"context bucket ({length!r}, {count!r}) must be two positive "
                                 "ints")
            if length <= prev:
                raise ValueError(f"context lengths must be strictly ascending, got {self.contexts}")
            prev = length
        _positive(self, "responses_in_flight", "micro_batch_tokens")
        if self.predicted_context < 0:
            raise ValueError(f"predicted_context must be >= 0, got {self.predicted_context}")
        if not 0 <= self.decode_fraction <= 1:
            raise ValueError(f"decode_fraction must be in [0, 1], got {self.decode_fraction}")

    @classmethod
    def of(cls, stage: Stage, lengths: "int | Iterable[int]", num_sequences: int = 1,
           **kwargs) -> "StageWorkload":
        """From one length (``num_sequences`` copies) or from a list of per-sequence lengths."""
        if isinstance(lengths, int):
            hist = {lengths: num_sequences}
        else:
            hist = {}
            for n in lengths:
                hist[n] = hist.get(n, 0) + 1
        return cls(stage=stage, contexts=tuple(sorted(hist.items())), **kwargs)

    def responses_per_replica(self, dp: int) -> int:
        """ROLLOUT: responses one of ``dp`` replicas is asked to run concurrently (it holds
        at most its share of the sequences)."""
        return max(1, min(math.ceil(self.responses_in_flight / dp),
                          math.ceil(self.num_sequences / dp)))

    @property
    def num_sequences(self) -> int:
        return sum(c for _, c in self.contexts)

    @property
    def max_context(self) -> int:
        """Longest sequence memory must hold: the longest present or the predicted one."""
        return max(self.contexts[-1][0], self.predicted_context)

    @property
    def total_tokens(self) -> int:
        return sum(n * c for n, c in self.contexts)

    @property
    def sum_sq_tokens(self) -> int:
        """Sum of squared lengths: causal attention work grows with it."""
        return sum(n * n * c for n, c in self.contexts)

    @property
    def mean_context(self) -> float:
        return self.total_tokens / self.num_sequences

    @property
    def effective_micro_batch_tokens(self) -> int:
        """Tokens of the largest micro-batch: the budget, or one whole longest sequence."""
        return max(self.micro_batch_tokens, self.max_context)

    def with_(self, **changes) -> "StageWorkload":
        return replace(self, **changes)

    def scaled_to(self, max_context: int) -> "StageWorkload":
        """The same histogram stretched so its longest sequence is ``max_context`` tokens."""
        top = self.contexts[-1][0]
        hist: dict[int, int] = {}
        for n, c in self.contexts:
            m = max(1, math.ceil(n * max_context / top))
            hist[m] = hist.get(m, 0) + c
        return replace(self, contexts=tuple(sorted(hist.items())))


@dataclass(frozen=True)
class TrainOptions:
    """How TRAIN runs; the other stages use ``param_dtype`` for weights and activations."""

    optimizer: str = "adam"
    distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam moments over the dp x cp group (Megatron's
    ``use_distributed_optimizer``)."""
    recompute: Recompute = Recompute.NONE
    param_dtype: Optional[str] = None
    """Dtype of weights and activations; None takes ``ModelConfig.params_dtype``."""
    grad_dtype: str = "float32"
    """Dtype of the DDP grad buffer (``main_grad``); fp32 is Megatron's default for bf16."""

    def __post_init__(self):
        if self.optimizer != "adam":
            raise ValueError(f"optimizer {self.optimizer!r} is not modelled; only 'adam' is")
        if not isinstance(self.recompute, Recompute):
            raise ValueError(f"recompute must be a Recompute, got {self.recompute!r}")
        if self.param_dtype is not None:
            dtype_bytes(self.param_dtype)
        dtype_bytes(self.grad_dtype)

    def param_bytes(self, model) -> int:
        """Bytes per weight (and per activation element) for ``model`` (a ModelConfig)."""
        return dtype_bytes(self.param_dtype or model.params_dtype)

    @property
    def grad_bytes(self) -> int:
        return dtype_bytes(self.grad_dtype)

    def optimizer_bytes_per_param(self, model) -> int:
        """Adam keeps exp_avg and exp_avg_sq in fp32 (8 B); with low-precision params it also keeps
        an fp32 master copy (4 B), as Megatron's mixed-precision optimizer does."""
        return 8 + (4 if self.param_bytes(model) < 4 else 0)

    def with_(self, **changes) -> "TrainOptions":
        return replace(self, **changes)

