"""The rollout's and the environment's configuration sections, and the SGLang servers' sizing.

``EnvConfig`` (what episodes are played in), ``RolloutConfig`` (the engine, the agent loop's
bounds, the placement of the rollout beside training) and the two numbers the SGLang servers are
started with and the selector plans with (``sglang_mem_fraction``, ``sglang_kv_tokens``). Frozen
dataclasses checked on construction: a bad value is a ``ConfigError`` naming the key and the fix.
Pure Python: no torch, no I/O. ``config/train.py`` assembles the sections (and re-exports these
names, so ``from earl_megatron.config.train import RolloutConfig`` keeps working).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from earl_megatron.config.checks import ConfigError
from earl_megatron.config.checks import at_least as _at_least


SGLANG_MEM_FRACTION = {"cpu": 0.05, "cuda": 0.8}
"""``--mem-fraction-static`` of the trainer's SGLang servers when rollout.sglang_mem_fraction is
null, by rollout.sglang_device. cpu: the kit's 0.05 of host memory (docs/sglang.md). cuda: 0.8,
below SGLang's own ~0.88 because the server is colocated with training (SGLang fills the device
up to the fraction counting the trainer's memory) and the selector keeps layout.memory_margin
(0.1) free: 0.8 + 0.1 leaves a tenth of the device for SGLang's activations and CUDA graphs."""


def sglang_mem_fraction(configured: Optional[float], device: str) -> float:
    """The one number the servers are started with and the selector plans with."""
    return SGLANG_MEM_FRACTION[device] if configured is None else configured


def sglang_kv_tokens(device: str, sequences: int, max_context_tokens: int) -> Optional[int]:
    """``--max-total-tokens`` of the trainer's SGLang servers: a cap on each server's KV pool.

    cpu: the rollout's worst case, ``sequences`` (the most episodes one play can hold at once:
    (max_staleness + 1) x episodes_per_iteration, or run.eval_episodes if more) of
    ``max_context_tokens`` each, whichever replica gets them. SGLang takes the smaller of this
    and what ``--mem-fraction-static`` leaves, so the cap only ever shrinks the pool: 5% of a
    24 GiB host is ~2 million tokens of a tiny model (~1 GB allocated and zeroed at every
    start, 1-12 s of it measured) where a run needs a few thousand. cuda: None, the fraction
    alone (the device's memory is the server's to use; the selector plans with the fraction)."""
    if device != "cpu":
        return None
    return max(1, sequences) * max_context_tokens



@dataclass(frozen=True)
class EnvConfig:
    name: str = "connect_four"
    """A registered environment (connect_four, tic_tac_toe, calculator; docs/envs.md), a
    factory of your own, ``package.module:function``, or ``agent``: agent programs of your own
    through the OpenAI-compatible endpoint (env.kwargs entry, tasks, reward; docs/agents.md)."""
    kwargs: dict = field(default_factory=dict)
    """Passed to make_env(name, **kwargs): opponent, mcts_simulations, invalid_penalty, ..."""
    eval_opponents: tuple = ("random",)
    """Opponents the policy is evaluated against (greedy and sampled), at the start, every
    run.eval_every iterations and at the end; empty: the environment's own opponent only."""


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "embedded"
    """"embedded" (Megatron-Core in the rollout layout) or "sglang" (HTTP servers)."""
    episodes_per_iteration: int = 64
    """Episodes played per RL iteration over all rollout replicas (a multiple of
    algorithm.group_size under grpo); at least the world size."""
    temperature: float = 1.0
    """Sampling temperature of the rollout (evaluation's sampled mode uses it too)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all)."""
    max_turns: int = 32
    """Agent turns per episode at most; an episode still running then ends (finish reason
    max_turns)."""
    max_context_tokens: Optional[int] = None
    """None: not capped (the model's max_position_embeddings bounds it)."""
    max_action_tokens: int = 4
    """Tokens the policy may sample in one turn (its action, or its message with a tool call)."""
    prefill_tokens: int = 8192
    """Tokens of one prefill forward of the embedded engine (its chunk; rows = this // width),
    and the ROLLOUT stage's chunk in the memory model (SGLang servers chunk by their own)."""
    tokenizer: str = "game"
    """"game" (28-symbol char vocabulary), "ascii" (104 symbols), "tool" (the calculator's: 64
    ids, its tags one token each) or an HF tokenizer directory. With run.init on the command
    line: run.init's directory when it holds a tokenizer, unless this key is given there."""
    sglang_python: Optional[str] = None
    """engine=sglang: Python of the SGLang venv (`make sglang` builds a CPU one); checked on
    every rank before any model or server is built."""
    sglang_bucket_mb: float = 512.0
    """engine=sglang: weight sync after each TRAIN step moves the model in buckets of at most
    this many MiB (gathered, converted to HF names, broadcast, freed), so no rank holds more
    than one bucket of other ranks' shards at once (slime's update_weight_buffer_size: 512 MB)."""
    sglang_device: str = "cuda"
    """engine=sglang: "cuda" (servers colocated on the rollout replica's GPUs, memory saver on)
    or "cpu" (separate processes, the kit's flags; tests and tiny models)."""
    sglang_mem_fraction: Optional[float] = None
    """engine=sglang: the servers' ``--mem-fraction-static`` (weights + static KV pool as a
    fraction of device memory; on cpu of host memory), also what the selector's memory model
    sizes their pool with. None: ``SGLANG_MEM_FRACTION`` (0.05 cpu, 0.8 cuda)."""
    sglang_restart_s: float = 60.0
    """engine=sglang: seconds the selector charges for restarting the servers in a new rollout
    (tp, dp) until the first start with that tp has been measured (the trainer records every
    start in its profile table, saved with checkpoints). 60: a server start measured 23-70 s on
    this 2-core CPU when quiet (minutes under load); on GPUs SGLang's imports, weight load and
    CUDA graph capture take about a minute as well."""
    env_concurrency: int = 16
    """Environments of a turn stepped at once (threads): a slow tool's wait overlaps across
    episodes (1: one after another). Each step's own guard (the calculator's tool_timeout_s)
    stays per call."""
    agent_concurrency: int = 16
    """env.name=agent: agent programs a replica runs at once (their calls batch together)."""
    agent_timeout_s: float = 600.0
    """env.name=agent: seconds an agent program may run; past it its episode is lost (counted
    in agent_timeouts) and the run goes on."""
    agent_host: str = "127.0.0.1"
    """env.name=agent: where the endpoint listens (loopback; 0.0.0.0 for agents on other
    machines, which then reach the replica leader's host name)."""
    agent_port: int = 0
    """env.name=agent: the endpoint's port (0: any free one; each replica leader binds its
    own)."""
    agent_public_url: Optional[str] = None
    """env.name=agent and ``earl serve``: the base URL agents are handed, e.g.
    ``http://node7:{port}`` (``{port}``: the port bound) or a proxy's URL. None: the listening
    host, and for a wildcard agent_host (0.0.0.0) this machine's fully qualified name."""
    agent_max_body_mb: float = 16.0
    """env.name=agent and ``earl serve``: a request body over this many MiB is refused with
    413 (request_too_large), read no further."""
    agent_max_batch: int = 64
    """env.name=agent and ``earl serve``: requests one ``generate`` call of the endpoint takes
    at most (the rest wait for the next); also the largest ``n`` a call may ask for."""
    placement: str = "colocated"
    """"colocated": every rank plays, then every rank trains (the stages in turn). "split":
    the last ``pool_ranks`` ranks are a rollout pool that plays while the first ranks, the
    train pool, train the batch before (trainer/split.py, docs/async.md); layout.mode=static:
    layout.train on the train pool, layout.rollout on the rollout pool; layout.mode=auto: the
    selector lays the pools out (and sizes them without pool_ranks). "auto": the selector's
    placement, colocated or a split, with its layouts (trainer/auto.py, plan/split.py),
    re-planned at every iteration from the lengths and the seconds measured (layout.mode=auto).
    One loop runs them all (trainer/loop.py)."""
    pool_ranks: Optional[int] = None
    """placement=split: ranks of the rollout pool (None: half the world, rounded down, with
    static layouts; the selector's count with layout.mode=auto)."""

    def __post_init__(self):
        if self.engine not in ("embedded", "sglang"):
            raise ConfigError(f"rollout.engine={self.engine!r}: use 'embedded' or 'sglang'")
        if self.sglang_bucket_mb <= 0:
            raise ConfigError(f"rollout.sglang_bucket_mb={self.sglang_bucket_mb} must be > 0")
        if self.sglang_device not in ("cuda", "cpu"):
            raise ConfigError(f"rollout.sglang_device={self.sglang_device!r}: use cuda or cpu")
        if self.sglang_mem_fraction is not None and not 0 < self.sglang_mem_fraction < 1:
            raise ConfigError(f"rollout.sglang_mem_fraction={self.sglang_mem_fraction} must be "
                              "in (0, 1) (null: 0.05 on cpu, 0.8 on cuda)")
        if not self.sglang_restart_s >= 0:
            raise ConfigError(f"rollout.sglang_restart_s={self.sglang_restart_s} must be >= 0")
        _at_least(self, "rollout", 1, "episodes_per_iteration", "max_turns", "max_action_tokens",
                  "prefill_tokens", "agent_concurrency", "env_concurrency", "pool_ranks",
                  "agent_max_batch")
        if not self.agent_max_body_mb > 0:
            raise ConfigError(f"rollout.agent_max_body_mb={self.agent_max_body_mb} must be > 0")
        if self.agent_public_url is not None and \
                not self.agent_public_url.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.agent_public_url={self.agent_public_url!r}: give a URL "
                              "such as http://HOST:{port} (or null)")
        if self.placement not in ("colocated", "split", "auto"):
            raise ConfigError(f"rollout.placement={self.placement!r}: use 'colocated', 'split' "
                              "or 'auto'")
        if self.pool_ranks is not None and self.placement != "split":
            raise ConfigError(f"rollout.pool_ranks={self.pool_ranks} sizes split placement's "
                              f"rollout pool: set rollout.placement=split, or drop it "
                              f"(placement={self.placement})")
        if not self.agent_timeout_s > 0 or not 0 <= self.agent_port < 65536:
            raise ConfigError(f"rollout.agent_timeout_s={self.agent_timeout_s} must be > 0 and "
                              f"rollout.agent_port={self.agent_port} in [0, 65535]")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.temperature={self.temperature} must be >= 0 and "
                              f"rollout.top_p={self.top_p} in (0, 1]")
        if self.max_context_tokens is not None and \
                self.max_context_tokens <= self.max_action_tokens:
            raise ConfigError(f"rollout.max_context_tokens={self.max_context_tokens} leaves no "
                              f"room for a prompt before a {self.max_action_tokens}-token turn")

