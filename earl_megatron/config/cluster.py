"""The cluster section of the configuration: the machines the selector plans for, and the run's timeouts.

One budget of timeouts (docs/trainer.md, Timeouts): a whole-world collective outlasts everything
one rank may do alone between two of them (an SGLang server's recovery with every restart), so
the restart logic acts before torch.distributed gives up; ``server_recovery_s`` is that worst
case and is checked below ``collective_timeout_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from earl_megatron.config.checks import ConfigError
from earl_megatron.config.checks import at_least as _at_least


@dataclass(frozen=True)
class ClusterConfig:
    preset: str = "cpu"
    """"cpu" (this machine) or "h100" (8x H100-80GB nodes)."""
    nodes: int = 1
    """Nodes of the job (torchrun's --nnodes; recipes/slurm/train.sbatch passes SLURM_NNODES);
    nodes x ranks per node must equal the world."""
    devices_per_node: Optional[int] = None
    """None: torchrun's LOCAL_WORLD_SIZE."""
    inter_node_gbps: Optional[float] = None
    """Network per node in Gbit/s, the selector's price of inter-node traffic (preset h100;
    None: 200). The cpu preset is one host and refuses it."""
    group_cache_layouts: int = 4
    """Layouts whose process groups stay alive between stages (runtime/groups.py); 0 or 1: none.
    4: the rollout, logprob and train layouts, and one more (runtime/groups' default too)."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective of the whole world (the default group: stage agreements, stop
    agreement, dispatcher rendezvous) may wait before torch.distributed aborts the job. It must
    outlast everything a rank may do alone between two such collectives (a server restart with
    all its tries, a checkpoint write), so that the restart logic acts first."""
    group_timeout_s: float = 600.0
    """Seconds a collective of a layout's process groups (tp, pp, cp, dp) may wait: a mismatched
    collective inside a stage fails in minutes. (The SGLang rollout's replica group waits
    through its leader's server restarts, so it takes collective_timeout_s.)"""
    world_backend: Optional[str] = None
    """torch.distributed backend string of the world (runtime/dist.py). None: the host's rule,
    "cpu:gloo,cuda:nccl" with GPUs, "gloo" without. "gloo" on a GPU host lets several ranks
    share one GPU, which NCCL refuses (the one-GPU check, benchmarks/gpu_check.py)."""
    server_start_timeout_s: float = 300.0
    """rollout.engine=sglang: seconds one server start may take until it answers /health as
    itself (weights arrive after, by the distributed update: a start loads no checkpoint)."""
    server_request_timeout_s: float = 300.0
    """rollout.engine=sglang: seconds one HTTP request (one turn's /generate batch, a weight
    update call) may go unanswered; past it the server counts as stalled and is restarted like
    a dead one, whatever its /health says."""
    server_max_restarts: int = 2
    """rollout.engine=sglang: restarts of one server per failure (a request, a weight push, a
    group setup) before the run fails; also the retries of a server's first start."""
    weight_sync_timeout_s: float = 120.0
    """rollout.engine=sglang: seconds the weight-update group (trainer rank + server ranks) may
    take to form, and one broadcast may wait, before the server counts as dead.
    rollout.placement=split: also the timeout of the weight handoff's own process group (train
    pool -> rollout pool, trainer/split.py): once every rank has reached the handoff, one
    of its ops may wait this long before the run fails naming the checkpoint it resumes from."""

    def __post_init__(self):
        _at_least(self, "cluster", 1, "nodes", "devices_per_node")
        if self.inter_node_gbps is not None:
            if self.preset == "cpu":
                raise ConfigError(f"cluster.inter_node_gbps={self.inter_node_gbps} does nothing "
                                  "under cluster.preset=cpu (one host, no network between "
                                  "ranks): drop it, or use cluster=h100")
            if self.inter_node_gbps <= 0:
                raise ConfigError(f"cluster.inter_node_gbps={self.inter_node_gbps} must be > 0")
        for key in ("collective_timeout_s", "group_timeout_s", "server_start_timeout_s",
                    "server_request_timeout_s", "weight_sync_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"cluster.{key}={getattr(self, key)} must be > 0 (seconds)")
        _at_least(self, "cluster", 0, "server_max_restarts")
        worst = self.server_recovery_s
        if worst >= self.collective_timeout_s:
            raise ConfigError(
                f"cluster.collective_timeout_s={self.collective_timeout_s:g} must exceed the "
                f"longest an SGLang server's recovery may keep one rank away from the others: "
                f"(server_max_restarts + 1) x server_request_timeout_s + server_max_restarts x "
                f"(server_start_timeout_s + weight_sync_timeout_s) = {worst:g} s, or a collective "
                f"gives up before the restart logic does. Raise cluster.collective_timeout_s "
                f"above {worst:g} or lower those (docs/trainer.md, Timeouts)")
        if self.world_backend is not None and not _device_mapped(self.world_backend):
            raise ConfigError(f"cluster.world_backend={self.world_backend!r}: use 'gloo', a "
                              "device-mapped string whose CPU entry is gloo such as "
                              "'cpu:gloo,cuda:nccl', or null for the host's rule")
        if self.group_cache_layouts < 0:
            raise ConfigError(f"cluster.group_cache_layouts={self.group_cache_layouts}: use "
                              "0 or 1 (no cache) or more")

    @property
    def server_recovery_s(self) -> float:
        """Worst seconds one failure of an SGLang server keeps its leader rank from the next
        collective: every allowed request times out, and every restart's start and weight
        restore runs to its limit (checked < collective_timeout_s)."""
        m = self.server_max_restarts
        return ((m + 1) * self.server_request_timeout_s
                + m * (self.server_start_timeout_s + self.weight_sync_timeout_s))


def _device_mapped(text: str) -> bool:
    """"gloo", or 'cpu:gloo,cuda:nccl'-shaped: device:backend entries, CPU tensors over gloo."""
    if text == "gloo":
        return True
    entries = [e.strip().split(":") for e in text.split(",")]
    return all(len(e) == 2 and e[0] in ("cpu", "cuda") and e[1] in ("gloo", "nccl")
               for e in entries) and ["cpu", "gloo"] in entries
