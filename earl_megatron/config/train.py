"""The trainer's configuration: frozen dataclasses, built once from Hydra's composed config.

``TrainConfig.from_dict`` is the only place a Hydra/OmegaConf container becomes configuration
(the conversion itself is config/conversion.py); library code sees these values only. Unknown
keys, wrong types, values out of range (every float finite, every count >= 1:
config/checks.py), impossible combinations and keys that would do nothing in the mode chosen
raise ``ConfigError`` naming the key and the fix, before any process group or model exists.

The sections live beside it: config/model.py, config/rollout.py (env, rollout and the SGLang
servers' sizing), config/algorithm.py, config/cluster.py, config/sft.py; layout and run are
here, with ``TrainConfig``, the checks that span sections, and ``config_notes`` (what the
configuration chose for the user, the run's first lines). Every name the sections define that
code imports from here is re-exported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from earl_megatron.config.algorithm import GROUPED, AlgorithmConfig
from earl_megatron.config.checks import ConfigError, require_finite
from earl_megatron.config.checks import at_least as _at_least
from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.conversion import build
from earl_megatron.config.model import ModelConfig
from earl_megatron.config.rollout import (
    SGLANG_MEM_FRACTION,
    EnvConfig,
    RolloutConfig,
    sglang_kv_tokens,
    sglang_mem_fraction,
)
from earl_megatron.config.sft import SFTConfig
from earl_megatron.stages import STAGE_NAMES

__all__ = ["SGLANG_MEM_FRACTION", "RECOMPUTE_CHOICES", "AlgorithmConfig", "ConfigError",
           "EnvConfig", "LayoutConfig", "RolloutConfig", "RunConfig", "TrainConfig",
           "config_notes", "sglang_kv_tokens", "sglang_mem_fraction"]

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
    loggers: tuple = ()
    """Trackers the metrics, the evaluations and this configuration are mirrored to, on rank 0
    (earl_megatron/trackers): any of tensorboard, wandb, mlflow, trackio, swanlab, e.g.
    run.loggers=[tensorboard,wandb]; each writes offline under output_dir unless its own
    environment variables point it at a server (docs/running.md, "Trackers"). Each needs its
    package: pip install earl_megatron[NAME]."""
    init: Optional[str] = None
    """HF directory or converted checkpoint to start from; None: random init from the seed. On
    the command line it is the model: its config.json (a converted checkpoint's model config)
    fills model.*, its tokenizer rollout.tokenizer (train.py ``apply_run_init``)."""
    samples_per_iteration: int = 4
    """Episodes of each iteration written decoded to <output_dir>/samples/iter_NNNNNN.jsonl by
    rank 0 (trainer/samples.py); the live view shows the latest. 0: none."""
    samples_all_replicas: bool = False
    """Every rollout replica's leader writes samples_per_iteration of its own episodes to
    samples/iter_NNNNNN.r<replica>.jsonl (no collective), so the viewer (earl view) shows the
    whole batch; false: rank 0's replica only."""

    def __post_init__(self):
        _at_least(self, "run", 1, "eval_episodes")
        _at_least(self, "run", 0, "iterations", "checkpoint_every", "eval_every",
                  "samples_per_iteration")
        from earl_megatron.config.loggers import check_names
        check_names(self.loggers)
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
        if self.model.lora.enabled and (lora_problem := _lora_problem(self)):
            raise ConfigError(f"model.lora.rank={self.model.lora.rank} with {lora_problem}")
        a, r = self.algorithm, self.rollout
        if (a.name in GROUPED or a.dynamic_sampling) and \
                r.episodes_per_iteration % a.group_size:
            raise ConfigError(
                f"rollout.episodes_per_iteration={r.episodes_per_iteration} must be a "
                f"multiple of algorithm.group_size={a.group_size}")
        if a.overlong_buffer and r.max_context_tokens is None:
            raise ConfigError(f"algorithm.overlong_buffer={a.overlong_buffer} shapes rewards "
                              "toward the context limit, and rollout.max_context_tokens is not "
                              "set: give rollout.max_context_tokens, or drop the buffer")
        if a.overlong_buffer and a.overlong_buffer >= r.max_context_tokens:
            raise ConfigError(f"algorithm.overlong_buffer={a.overlong_buffer} must be below "
                              f"rollout.max_context_tokens={r.max_context_tokens} (the penalty "
                              "ramps over the last overlong_buffer tokens before it)")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return build(cls, d, "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _split_problem(cfg: "TrainConfig") -> Optional[str]:
    """What split placement (trainer/split.py) does not run yet in ``cfg``, with the fix;
    None: it runs."""
    a, r, lay = cfg.algorithm, cfg.rollout, cfg.layout
    if a.max_staleness < 1:
        return ("the rollout pool plays the next batch while the train pool trains this one, "
                "one version behind: set algorithm.max_staleness >= 1")
    if r.placement == "auto" and lay.mode != "auto":
        return ("layout.mode=static: auto placement plans the pools' sizes and their layouts "
                "together; set layout.mode=auto, or rollout.placement=split with "
                "rollout.pool_ranks")
    return None


def _lora_problem(cfg: "TrainConfig") -> Optional[str]:
    """What the loop does not do yet with LoRA adapters (issue #46), naming the limit and the
    fix; None: it runs. The layout switcher, the split placement's handoff and SGLang's servers
    move adapters (the tensor table has their rows) and run.init gives the base (fresh adapters
    over it), but the KL reference (the policy's base, adapters off) is not the warmed policy a
    warm start would make it."""
    if cfg.sft.steps and cfg.algorithm.kl_mode != "off":
        return (f"sft.steps={cfg.sft.steps} and algorithm.kl_mode={cfg.algorithm.kl_mode}: the "
                "KL reference of a LoRA run is its base without adapters, not the warmed policy "
                "(issue #46); set algorithm.kl_mode=off, or sft.steps=0")
    return None


PRETRAINED_LR_MAX = 1e-3
"""An RL learning rate at or above this, on a pretrained checkpoint (run.init), gets a note:
the default recipe's 1e-2 is the tiny random model's; SmolLM2's recipes train at 2e-5 (2e-4 for
adapters), the Qwen recipes at 5e-7..1e-6, and at 1e-2 a real model's replies degrade to noise
within an iteration or two."""


def config_notes(cfg: TrainConfig) -> list[str]:
    """The lines a run starts with that say what the configuration chose for the user, or what
    it holds that is likely a mistake (the trainer shows them before anything else,
    trainer/runner.py ``drive``): the off-policy correction and the old logprobs that
    ``algorithm.off_policy=auto`` and ``algorithm.old_logprobs=auto`` resolved to
    (config/algorithm.py), and a random-init learning rate on a pretrained checkpoint
    (``PRETRAINED_LR_MAX``). Empty when neither applies, so a k=0 run starts as it always
    did."""
    return _async_notes(cfg) + _lr_notes(cfg)


def _lr_notes(cfg: TrainConfig) -> list[str]:
    a = cfg.algorithm
    if cfg.run.init is None or a.lr < PRETRAINED_LR_MAX:
        return []
    return [f"algorithm.lr={a.lr:g} on the pretrained run.init={cfg.run.init}: that rate is "
            "for a randomly initialised model; a pretrained one usually RL-trains at 1e-6 to "
            "5e-5 (recipes/smollm2_tool.yaml: 2e-5, 2e-4 with LoRA adapters); set algorithm.lr"]


def _async_notes(cfg: TrainConfig) -> list[str]:
    a = cfg.algorithm
    if not a.chosen or a.off_policy_weights is None:
        return []
    mode, cap = a.off_policy_weights
    what = {"decoupled": f"decoupled PPO (a token whose weight pi_prox / pi_behav exceeds "
                         f"{cap:g} is dropped)",
            "tis": f"truncated importance sampling (weights pi_prox / pi_behav capped at "
                   f"{cap:g})"}[mode]
    given = (f"algorithm.max_staleness={a.max_staleness} (asynchronous RL)"
             if "off_policy" in a.chosen else f"algorithm.off_policy={a.off_policy}")
    chosen = ", ".join(f"algorithm.{name}={getattr(a, name)}" for name in a.chosen)
    them = "them" if len(a.chosen) > 1 else "it"
    return [f"{given}: {what} on the trainer's re-scoring of each batch before TRAIN; chosen "
            f"for you: {chosen} (set {them} to choose otherwise)"]

