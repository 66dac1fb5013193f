"""The trainer's configuration: frozen dataclasses, built once from Hydra's composed config.

``TrainConfig.from_dict`` is the only place a Hydra/OmegaConf container becomes configuration
(the conversion itself is config/conversion.py); library code sees these values only. Unknown
keys, wrong types, values out of range (every float finite, every count >= 1:
config/checks.py), impossible combinations and keys that would do nothing in the mode chosen
raise ``ConfigError`` naming the key and the fix, before any process group or model exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from earl_megatron.config.checks import ConfigError, require_finite
from earl_megatron.config.checks import at_least as _at_least
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.conversion import build
from earl_megatron.config.model import ModelConfig
from earl_megatron.config.sft import SFTConfig
from earl_megatron.stages import STAGE_NAMES


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


RECOMPUTE_CHOICES = ("auto", "none", "selective", "full")


@dataclass(frozen=True)
class LayoutConfig:
    mode: str = "auto"
    """"auto": the selector picks a layout per stage every iteration; "static": use the strings."""
    rollout: Optional[str] = None
    """Static layout of the ROLLOUT stage, e.g. "tp2" (dp inferred); required when static."""
    logprob: Optional[str] = None
    """Static layout of the LOGPROB stage (reference / old-policy scoring); required when
    static."""
    train: Optional[str] = None
    """Static layout of the TRAIN stage; required when static."""
    memory_budget_gb: Optional[float] = None
    """Per-rank memory budget the selector plans against (None: the cluster's device memory)."""
    memory_margin: float = 0.1
    """Fraction of the budget kept free: a layout fits when its predicted bytes stay under
    budget x (1 - margin)."""
    hysteresis: float = 0.05
    """A stage leaves its current layout only for one predicted faster by more than this
    fraction, switch cost included."""
    max_tp: Optional[int] = None
    """Largest tp the selector considers (None: any that divides the model and the world)."""
    max_cp: Optional[int] = None
    """Largest cp the selector considers (None: any)."""
    max_pp: Optional[int] = None
    """Largest pp the selector considers (None: any that divides num_layers)."""
    recompute: str = "auto"
    """TRAIN activation recomputation (Megatron-Core's): "auto" (the selector picks per
    iteration, with the layout, the fastest mode that fits; none when it fits and is fastest),
    or "none", "selective" (the core attention), "full" (every layer) for the whole run."""

    def __post_init__(self):
        _at_least(self, "layout", 1, "max_tp", "max_cp", "max_pp")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ConfigError(f"layout.recompute={self.recompute!r}: use one of "
                              f"{list(RECOMPUTE_CHOICES)}")
        if not 0.0 <= self.memory_margin < 1.0 or self.hysteresis < 0:
            raise ConfigError(f"layout.memory_margin={self.memory_margin} must be in [0, 1) and "
                              f"layout.hysteresis={self.hysteresis} >= 0")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise ConfigError(f"layout.memory_budget_gb={self.memory_budget_gb} must be > 0 "
                              "(null: the device's memory)")
        if self.mode not in ("auto", "static"):
            raise ConfigError(f"layout.mode={self.mode!r}: use 'auto' or 'static'")
        if self.mode == "static":
            missing = [s for s in STAGE_NAMES if getattr(self, s) is None]
            if missing:
                raise ConfigError(f"layout.mode=static needs a layout for {missing}: e.g. "
                                  f"layout.{missing[0]}=tp2 (or layout.mode=auto)")

    def static(self, stage: str) -> Optional[str]:
        return getattr(self, stage) if self.mode == "static" else None


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
    placement: str = "colocated"
    """"colocated": every rank plays, then every rank trains (the stages in turn). "split":
    the last ``pool_ranks`` ranks are a rollout pool that plays while the first ranks, the
    train pool, train the batch before (trainer/split_loop.py, docs/async.md); layouts
    static (layout.train on the train pool, layout.rollout on the rollout pool). "auto": split,
    with the pools' sizes and layouts the selector's (plan/split.py), re-planned at every
    iteration from the lengths and the seconds each pool measured (layout.mode=auto)."""
    pool_ranks: Optional[int] = None
    """placement=split: ranks of the rollout pool (None: half the world, rounded down)."""

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
                  "prefill_tokens", "agent_concurrency", "env_concurrency", "pool_ranks")
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


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "reinforce_pp"
    """The advantage estimator: "reinforce_pp" (REINFORCE++: per-turn returns normalised over
    the batch's policy tokens) or "grpo" (episode rewards normalised within groups). Both train
    the PPO-clip surrogate without a critic; ``epochs`` > 1 reuses each batch (the recipe
    algorithm=reinforce_pp_multi_epoch). No critic is trained, so no name says PPO."""
    lr: float = 1e-3
    """Adam's learning rate (Megatron's optimizer)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of Adam (AdamW)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip before each optimizer step (0: none)."""
    group_size: int = 1
    """GRPO: episodes per group sharing one environment seed."""
    epochs: int = 1
    """Optimizer passes over each batch; > 1 makes the clipped ratio bite (old logprobs fixed
    at the batch's sampling policy)."""
    clip_eps: float = 0.2
    """PPO-clip's epsilon: the ratio pi / pi_old is clipped to [1 - eps, 1 + eps]."""
    gamma: float = 1.0
    """Per-turn discount of the REINFORCE++ returns (1: every turn gets all later rewards).
    GRPO scores whole episodes, so it takes only 1."""
    kl_mode: str = "off"
    """KL to the reference policy (the initial one, frozen): "off"; "loss" (k3 estimator in the
    per-token loss); or "reward" (k1 = logp - ref_logp subtracted from the rewards, REINFORCE++
    style; GRPO: the episode's summed k1 off its reward). Not "off": a LOGPROB stage runs."""
    kl_coef: float = 0.0
    """Weight of the KL (> 0 when kl_mode is not "off")."""
    entropy_coef: float = 0.0
    """Entropy bonus per policy token (0: off; > 0 trains through the logits path)."""
    micro_batch_size: int = 4
    """Samples per micro-batch at most (length-grouped: neighbours in length train together)."""
    micro_batch_tokens: Optional[int] = None
    """Padded tokens per micro-batch at most (None: no limit); a longer sample trains alone, so
    activation memory follows the longest episode, not micro_batch_size times it."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: Adam's state sharded over the dp (x cp) ranks."""
    old_logprobs: str = "rollout"
    """Old logprobs of the PPO ratio: "rollout" (the engine's, as sampled) or "recompute" (the
    policy re-scores its episodes before TRAIN; trainer/old_logprobs.py)."""
    off_policy: str = "none"
    """How tokens sampled by other weights than the trained ones are corrected, each token's
    policy-gradient term weighted by w = pi_prox / pi_behav (pi_behav: the engine's logprobs as
    sampled; pi_prox: the policy re-scoring the batch at the start of TRAIN, which is the PPO
    ratio's denominator): "none" (no weight); "tis" (truncated importance sampling, verl's and
    slime's: w capped at ``off_policy_cap``); "decoupled" (decoupled PPO, AReaL's: tokens with
    w > ``off_policy_cap`` dropped, w otherwise). Both but "none" need old_logprobs=recompute;
    with max_staleness >= 1 "none" is refused (stale tokens would go uncorrected)."""
    off_policy_cap: Optional[float] = None
    """The cap of w: off_policy=tis truncates at it, decoupled drops tokens above it (None: 2.0,
    verl's and slime's usual value; refused with off_policy=none, which reads no cap)."""
    max_staleness: int = 0
    """Asynchronous RL: how many train steps older than the trained weights a trained token's
    sampling weights may be (docs/async.md). 0: the synchronous loop (every episode played and
    trained in one iteration). k >= 1: up to (k + 1) batches of episodes are in flight, a
    rollout stage ends when one batch has finished, and unfinished episodes continue in the
    next stage (dropped, and counted, when they would break the bound)."""
    routing_replay: bool = False
    """Mixture-of-experts only: the rollout records the experts each token was routed to and
    the LOGPROB (old / reference) and TRAIN forwards reuse them (Megatron-Core's RouterReplay;
    rollout/routing_replay.py), so a token near a routing tie cannot land on other experts in
    training than it did when sampled. Embedded engine only."""

    @property
    def off_policy_weights(self) -> Optional[tuple[str, float]]:
        """(mode, cap) of the off-policy weights, or None (off_policy=none)."""
        if self.off_policy == "none":
            return None
        return (self.off_policy, 2.0 if self.off_policy_cap is None else self.off_policy_cap)

    def __post_init__(self):
        if self.old_logprobs not in ("rollout", "recompute"):
            raise ConfigError(f"algorithm.old_logprobs={self.old_logprobs!r}: use rollout or "
                              "recompute")
        _at_least(self, "algorithm", 1, "group_size", "epochs", "micro_batch_size",
                  "micro_batch_tokens")
        if self.lr <= 0 or self.weight_decay < 0 or self.clip_grad < 0 or self.clip_eps < 0:
            raise ConfigError(f"algorithm.lr={self.lr} must be > 0 and weight_decay, clip_grad, "
                              "clip_eps >= 0")
        if self.name == "ppo":
            raise ConfigError("algorithm.name=ppo: earl_megatron trains no critic (no value "
                              "model, no GAE); PPO-clip without a critic over several epochs is "
                              "algorithm.name=reinforce_pp with algorithm.epochs=2 (the recipe "
                              "algorithm=reinforce_pp_multi_epoch)")
        if self.name not in ("reinforce_pp", "grpo"):
            raise ConfigError(f"algorithm.name={self.name!r}: use reinforce_pp or grpo")
        if self.kl_mode not in ("off", "loss", "reward"):
            raise ConfigError(f"algorithm.kl_mode={self.kl_mode!r}: use off, loss or reward")
        if self.kl_mode != "off" and self.kl_coef <= 0:
            raise ConfigError(f"algorithm.kl_mode={self.kl_mode} needs algorithm.kl_coef > 0")
        if self.kl_mode == "off" and self.kl_coef:
            raise ConfigError(f"algorithm.kl_coef={self.kl_coef} does nothing with "
                              "algorithm.kl_mode=off (no reference policy): set "
                              "algorithm.kl_mode=loss or reward, or drop the coefficient")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"algorithm.gamma={self.gamma}: use a discount in [0, 1]")
        if self.name == "grpo" and self.group_size < 2:
            raise ConfigError("algorithm.name=grpo needs algorithm.group_size >= 2")
        if self.name == "grpo" and self.gamma != 1.0:
            raise ConfigError(f"algorithm.gamma={self.gamma} does nothing under "
                              "algorithm.name=grpo (GRPO scores whole episodes, no per-turn "
                              "returns): drop it, or use algorithm.name=reinforce_pp")
        if self.entropy_coef < 0:
            raise ConfigError(f"algorithm.entropy_coef={self.entropy_coef} must be >= 0")
        if self.off_policy not in ("none", "tis", "decoupled"):
            raise ConfigError(f"algorithm.off_policy={self.off_policy!r}: use none, tis or "
                              "decoupled")
        if self.off_policy_cap is not None and not self.off_policy_cap > 0:
            raise ConfigError(f"algorithm.off_policy_cap={self.off_policy_cap} must be > 0 (or "
                              "null: 2.0)")
        if self.off_policy_cap is not None and self.off_policy == "none":
            raise ConfigError(f"algorithm.off_policy_cap={self.off_policy_cap} does nothing "
                              "with algorithm.off_policy=none: set off_policy=tis or decoupled, "
                              "or drop the cap")
        if self.off_policy != "none" and self.old_logprobs != "recompute":
            raise ConfigError(f"algorithm.off_policy={self.off_policy} weights by pi_prox / "
                              "pi_behav, which needs the trainer's re-scoring: set "
                              "algorithm.old_logprobs=recompute (with 'rollout' the ratio is 1 "
                              "by definition)")
        if self.max_staleness < 0:
            raise ConfigError(f"algorithm.max_staleness={self.max_staleness} must be >= 0 "
                              "(0: synchronous)")
        if self.max_staleness and self.off_policy == "none":
            raise ConfigError(f"algorithm.max_staleness={self.max_staleness} trains tokens "
                              "sampled by older weights: choose their correction, "
                              "algorithm.off_policy=decoupled (or tis), with "
                              "algorithm.old_logprobs=recompute")


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    """Seeds the initial weights, the environments' episodes and the sampling (earl_megatron/
    seeds.py's streams); two runs of one seed give the same metrics."""
    iterations: int = 40
    """RL iterations; 0: evaluate the starting policy (after the warm start, if any) and stop
    (verl's val_only): how a base model is measured before RL."""
    output_dir: str = "runs/default"
    """The run's directory: metrics.jsonl, eval.json, samples/, checkpoints/, logs/."""
    checkpoint_every: int = 10
    """Iterations between checkpoints (0: only on SIGTERM and at the end)."""
    resume: bool = True
    """Continue from output_dir's newest complete checkpoint when one exists (a damaged newer
    one is skipped with a message). false: start anew, which output_dir must allow: a folder
    that already holds a run (metrics, evaluations or checkpoints) is refused rather than
    overwritten; choose a new output_dir or delete the old one."""
    keep_last: Optional[int] = 3
    """Complete checkpoints kept (RL and warm start each); older ones are deleted, oldest
    first, once a newer one is complete on disk. null: keep every checkpoint."""
    eval_every: int = 0
    """Iterations between evaluations (0: at start and end only)."""
    eval_episodes: int = 64
    """Episodes of each evaluation, per opponent and mode (greedy, sampled)."""
    live_view: bool = True
    """rich live display on rank 0 when stdout is a terminal (plain lines otherwise or when off)."""
    tensorboard: bool = False
    """Mirror the metrics to <output_dir>/tensorboard (needs the tensorboard package)."""
    init: Optional[str] = None
    """HF directory or converted checkpoint to start from; None: random init from the seed. On
    the command line it is the model: its config.json (a converted checkpoint's model config)
    fills model.*, its tokenizer rollout.tokenizer (train.py ``apply_run_init``)."""
    samples_per_iteration: int = 4
    """Episodes of each iteration written decoded to <output_dir>/samples/iter_NNNNNN.jsonl by
    rank 0 (trainer/samples.py); the live view shows the latest. 0: none."""

    def __post_init__(self):
        _at_least(self, "run", 1, "eval_episodes")
        _at_least(self, "run", 0, "iterations", "checkpoint_every", "eval_every",
                  "samples_per_iteration")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"run.keep_last={self.keep_last} would keep no checkpoint: use "
                              ">= 1, or null to keep every checkpoint")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig.tiny)
    """The policy's architecture (recipes/model/*.yaml; with run.init, the checkpoint's)."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """How each stage's parallel layout is chosen: the selector (auto) or fixed strings."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment episodes are played in."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The engine and the agent loop's bounds."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The estimator, the loss and the optimizer."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The machines the selector plans for, and the timeouts of the run's collectives."""
    run: RunConfig = field(default_factory=RunConfig)
    """Iterations, seed, output, checkpoints, evaluations."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start before RL (sft.steps = 0: none); trainer/warm_start.py."""

    def __post_init__(self):
        require_finite(self, "")  # every float of every section, nan and inf included
        if self.algorithm.routing_replay and not self.model.is_moe:
            raise ConfigError(
                f"algorithm.routing_replay=true needs a mixture-of-experts model (model.family="
                f"{self.model.family!r} has no router); set it false or use model.family=qwen3_moe")
        if self.algorithm.routing_replay and self.rollout.engine != "embedded":
            raise ConfigError(
                f"algorithm.routing_replay=true records the experts in the embedded engine; "
                f"rollout.engine={self.rollout.engine!r} does not return them: use "
                "rollout.engine=embedded or routing_replay=false")
        if self.rollout.placement != "colocated":
            split_problem = _split_problem(self)
            if split_problem:
                raise ConfigError(f"rollout.placement={self.rollout.placement}: "
                                  f"{split_problem}")
        if self.algorithm.name == "grpo" and \
                self.rollout.episodes_per_iteration % self.algorithm.group_size:
            raise ConfigError(
                f"rollout.episodes_per_iteration={self.rollout.episodes_per_iteration} must be a "
                f"multiple of algorithm.group_size={self.algorithm.group_size}")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return build(cls, d, "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _split_problem(cfg: "TrainConfig") -> Optional[str]:
    """What split placement (trainer/split_loop.py) does not run yet in ``cfg``, with the fix;
    None: it runs."""
    a, r, lay = cfg.algorithm, cfg.rollout, cfg.layout
    if a.max_staleness < 1:
        return ("the rollout pool plays the next batch while the train pool trains this one, "
                "one version behind: set algorithm.max_staleness >= 1")
    if r.engine == "sglang" and (r.placement == "auto" or lay.mode == "auto"):
        return ("rollout.engine=sglang: a planned placement (auto, or split with layout.mode="
                "auto) does not move SGLang servers between pools yet (a move would restart "
                "them on other ranks); use rollout.placement=split with rollout.pool_ranks and "
                "layout.mode=static")
    if r.placement == "auto" and lay.mode != "auto":
        return ("layout.mode=static: auto placement plans the pools' sizes and their layouts "
                "together; set layout.mode=auto, or rollout.placement=split with "
                "rollout.pool_ranks")
    if r.placement == "split" and lay.mode == "static" and lay.logprob != lay.train:
        return (f"layout.logprob={lay.logprob}: the train pool re-scores its batch in "
                f"layout.train={lay.train}; set layout.logprob to the same")
    return None
