"""The algorithm section: the estimator, the loss, the optimizer and asynchrony.

``AlgorithmConfig`` is frozen and checked on construction (a bad value or an impossible
combination is a ``ConfigError`` naming the key and the fix). Two fields default to ``"auto"``,
"chosen from max_staleness", and are resolved once, in ``__post_init__``, before any check reads
them, so that ``algorithm.max_staleness=1`` alone is asynchronous RL with decoupled PPO on the
trainer's re-scoring (``chosen_for``):

    max_staleness   off_policy=auto   old_logprobs=auto
    0               none              rollout      (the synchronous defaults, unchanged)
    >= 1            decoupled         recompute    (AReaL's decoupled PPO, docs/async.md)

and ``old_logprobs=auto`` is recompute too whenever the off-policy weights need it (off_policy
tis or decoupled given at k=0). A value the user gives always wins; no field holds "auto" after
construction, so ``to_dict`` (resolved.json) records what the run does, and which fields were
chosen is kept in ``chosen`` (not a field: equal configs compare equal) for the run's first
lines (config/train.py ``config_notes``). Pure Python: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from earl_megatron.config.checks import ConfigError
from earl_megatron.config.checks import at_least as _at_least
from earl_megatron.config.critic import CriticConfig

ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "grpo", "rloo", "ppo")
GROUPED = ("reinforce_pp_baseline", "grpo", "rloo")
"""The estimators whose baseline is the group's (they need group_size >= 2)."""
POLICY_LOSSES = ("ppo_clip", "gspo", "gspo_token", "cispo")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
             "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")

AUTO = "auto"
"""The value of algorithm.off_policy and algorithm.old_logprobs that says "chosen from
algorithm.max_staleness" (module docstring)."""


def chosen_for(max_staleness: int, off_policy: str, old_logprobs: str) -> tuple[str, str]:
    """(off_policy, old_logprobs) with each ``AUTO`` replaced by what ``max_staleness`` (and a
    given off_policy) choose; a given value is kept as given (module docstring's table)."""
    if off_policy == AUTO:
        off_policy = "decoupled" if max_staleness >= 1 else "none"
    if old_logprobs == AUTO:
        # the off-policy weights pi_prox / pi_behav need pi_prox, the trainer's re-scoring
        old_logprobs = "recompute" if off_policy != "none" else "rollout"
    return off_policy, old_logprobs


@dataclass(frozen=True)
class AlgorithmConfig:
    name: str = "reinforce_pp"
    """The advantage estimator (docs/algorithms.md): "reinforce_pp" (REINFORCE++: per-turn
    returns normalised over the batch's policy tokens); "reinforce_pp_baseline" (the episode
    reward minus its group's mean, then normalised over the batch's policy tokens); "grpo"
    (episode rewards normalised within groups; ``norm_by_std=false``: Dr. GRPO's unscaled
    r - mean); "rloo" (the reward minus the mean of the group's other rewards); "ppo" (GAE
    over the policy tokens with a learned critic, ``lam`` and ``critic``, normalised over the
    batch's policy tokens: trainer/critic.py). ``epochs`` > 1 reuses each batch
    (algorithm=reinforce_pp_multi_epoch), the critic's too under ppo."""
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
    """PPO-clip's epsilon: the ratio pi / pi_old is clipped to [1 - eps, 1 + eps] (both sides
    unless clip_eps_low / clip_eps_high are given)."""
    clip_eps_low: Optional[float] = None
    """The lower epsilon: the ratio is clipped below at 1 - clip_eps_low (None: clip_eps). With
    policy_loss=gspo it bounds the sequence ratio; with cispo the clipped weight."""
    clip_eps_high: Optional[float] = None
    """The upper epsilon (None: clip_eps); DAPO's clip-higher sets it above clip_eps_low."""
    dual_clip: Optional[float] = 10.0
    """Dual clip (Ye et al. 2020) of policy_loss=ppo_clip: a negative advantage's loss is
    bounded by dual_clip * |A| however large the ratio (None: off; must exceed 1)."""
    policy_loss: str = "ppo_clip"
    """The policy loss (rl/losses.py, docs/algorithms.md): "ppo_clip" (the clipped surrogate
    per token); "gspo" (GSPO, Zheng et al. 2025: the sequence ratio, the geometric mean of the
    episode's token ratios, clipped with the sequence's mean advantage); "gspo_token" (GSPO's
    token variant: the same ratio, each token's own advantage); "cispo" (CISPO, MiniMax-M1:
    the clipped ratio, stop-gradient, times the advantage and the token's logprob)."""
    loss_agg: str = "token_mean"
    """How per-token losses add up to the batch's loss, over the GLOBAL batch: "token_mean"
    (every policy token weighs the same); "seq_mean_token_mean" (each episode's token mean,
    then the mean over episodes); "seq_mean_token_sum" (each episode's token sum, then the mean
    over episodes); "seq_mean_token_sum_norm" (Dr. GRPO: the token sums over episodes times a
    constant, loss_agg_tokens)."""
    loss_agg_tokens: Optional[int] = None
    """seq_mean_token_sum_norm's constant normaliser, in tokens (None: rollout.max_turns x
    rollout.max_action_tokens, the most policy tokens an episode can sample)."""
    norm_by_std: bool = True
    """grpo: divide r - mean by the group's std (false: Dr. GRPO's unscaled advantages)."""
    gamma: float = 1.0
    """Per-turn discount of the REINFORCE++ returns (1: every turn gets all later rewards);
    under ppo GAE's per-POLICY-TOKEN discount (rl/value.py). GRPO scores whole episodes, so it
    takes only 1."""
    lam: float = 1.0
    """ppo: GAE's lambda (``lambda`` is Python's keyword): 1 the Monte-Carlo return minus the
    value, 0 the one-step TD error. Other estimators refuse another value."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """ppo: the value model (``CriticConfig``); its keys are refused off ppo."""
    kl_mode: str = "off"
    """KL to the reference policy (the initial one, frozen): "off"; "loss" (k3 estimator in the
    per-token loss); or "reward" (k1 = logp - ref_logp subtracted from the rewards, REINFORCE++
    style; GRPO: the episode's summed k1 off its reward). Not "off": a LOGPROB stage runs."""
    kl_coef: float = 0.0
    """Weight of the KL (> 0 when kl_mode is not "off")."""
    kl_estimator: str = AUTO
    """The per-token estimator of KL(pi || ref) (Schulman's names; rl/losses.py): "k1"
    (log pi - log ref), "k2" ((log pi - log ref)^2 / 2), "k3" (exp(log ref - log pi) - (log ref
    - log pi) - 1), "low_var_kl" (k3 clamped to [-10, 10], verl's); "auto": k3 in the loss, k1
    in the reward ("none" with kl_mode=off, where no KL is estimated)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal carries no signal; it is
    dropped (counted) and more groups are played until the batch is full or
    dynamic_sampling_rounds extra rounds were played. Needs group_size >= 2."""
    dynamic_sampling_rounds: int = 4
    """Extra rounds of groups dynamic sampling may play per batch (the batch then trains with
    the groups it has)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: a truncated episode (finish reason max_turns or max_context)
    is masked out of the loss (it still counts in the statistics of its group)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment, in tokens (0: off): an episode whose length L passes
    rollout.max_context_tokens - overlong_buffer loses overlong_penalty x (L - (max -
    buffer)) / buffer from its reward (all of overlong_penalty past the limit)."""
    overlong_penalty: float = 1.0
    """The most the soft overlong punishment takes off a reward."""
    entropy_coef: float = 0.0
    """Entropy bonus per policy token (0: off; > 0 trains through the logits path)."""
    micro_batch_size: int = 4
    """Samples per micro-batch at most (length-grouped: neighbours in length train together)."""
    micro_batch_tokens: Optional[int] = None
    """Padded tokens per micro-batch at most (None: no limit); a longer sample trains alone, so
    activation memory follows the longest episode, not micro_batch_size times it."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: Adam's state sharded over the dp (x cp) ranks."""
    old_logprobs: str = AUTO
    """Old logprobs of the PPO ratio: "rollout" (the engine's, as sampled), "recompute" (the
    policy re-scores its episodes before TRAIN; trainer/old_logprobs.py) or "auto" (chosen:
    recompute when off_policy is not "none", as under max_staleness >= 1; rollout otherwise)."""
    off_policy: str = AUTO
    """How tokens sampled by other weights than the trained ones are corrected, each token's
    policy-gradient term weighted by w = pi_prox / pi_behav (pi_behav: the engine's logprobs as
    sampled; pi_prox: the policy re-scoring the batch at the start of TRAIN, which is the PPO
    ratio's denominator): "none" (no weight); "tis" (truncated importance sampling, verl's and
    slime's: w capped at ``off_policy_cap``); "decoupled" (decoupled PPO, AReaL's: tokens with
    w > ``off_policy_cap`` dropped, w otherwise); "auto" (chosen from max_staleness: none at 0,
    decoupled at >= 1). Both but "none" need old_logprobs=recompute; with max_staleness >= 1
    "none" is refused (stale tokens would go uncorrected)."""
    off_policy_cap: Optional[float] = None
    """The cap of w: off_policy=tis truncates at it, decoupled drops tokens above it (None: 2.0,
    verl's and slime's usual value; refused with off_policy=none, which reads no cap)."""
    max_staleness: int = 0
    """Asynchronous RL: how many train steps older than the trained weights a trained token's
    sampling weights may be (docs/async.md). 0: the synchronous loop (every episode played and
    trained in one iteration). k >= 1: up to (k + 1) batches of episodes are in flight, a
    rollout stage ends when one batch has finished, and unfinished episodes continue in the
    next stage (dropped, and counted, when they would break the bound). Alone (off_policy and
    old_logprobs left at auto; the recipe algorithm=async) k >= 1 is decoupled PPO on the
    trainer's re-scoring."""
    routing_replay: bool = False
    """Mixture-of-experts only: the rollout records the experts each token was routed to and
    the LOGPROB (old / reference) and TRAIN forwards reuse them (Megatron-Core's RouterReplay;
    rollout/routing_replay.py), so a token near a routing tie cannot land on other experts in
    training than it did when sampled. Embedded engine only."""

    @property
    def clip_low(self) -> float:
        """The lower clip epsilon in force (clip_eps_low, else clip_eps)."""
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def clip_high(self) -> float:
        """The upper clip epsilon in force (clip_eps_high, else clip_eps)."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    def _check_menu(self) -> None:
        """The menu's keys (docs/algorithms.md): each value known, none that does nothing in
        this combination, none that means nothing (GSPO over tokens, dynamic sampling without
        groups)."""
        if self.kl_estimator == AUTO:
            object.__setattr__(self, "kl_estimator", {"off": "none", "loss": "k3",
                                                      "reward": "k1"}[self.kl_mode])
        if self.kl_mode == "off" and self.kl_estimator != "none":
            raise ConfigError(f"algorithm.kl_estimator={self.kl_estimator} does nothing with "
                              "algorithm.kl_mode=off (no reference policy): set kl_mode=loss "
                              "or reward, or drop it")
        estimators = ("none",) if self.kl_mode == "off" else KL_ESTIMATORS
        for key, options in (("policy_loss", POLICY_LOSSES), ("loss_agg", LOSS_AGGS),
                             ("kl_estimator", estimators)):
            if getattr(self, key) not in options:
                raise ConfigError(f"algorithm.{key}={getattr(self, key)!r}: use "
                                  f"{', '.join(options)}")
        for key in ("clip_eps_low", "clip_eps_high"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ConfigError(f"algorithm.{key}={getattr(self, key)} must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ConfigError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (or null: off)")
        if self.policy_loss.startswith("gspo") and self.loss_agg != "seq_mean_token_mean":
            raise ConfigError(f"algorithm.policy_loss={self.policy_loss} is a sequence-level "
                              f"objective; algorithm.loss_agg={self.loss_agg} would weigh "
                              "episodes by their length: set algorithm.loss_agg="
                              "seq_mean_token_mean (the recipe algorithm=gspo does)")
        if self.loss_agg_tokens is not None and self.loss_agg != "seq_mean_token_sum_norm":
            raise ConfigError(f"algorithm.loss_agg_tokens={self.loss_agg_tokens} does nothing "
                              f"with algorithm.loss_agg={self.loss_agg}: drop it, or set "
                              "loss_agg=seq_mean_token_sum_norm")
        if self.loss_agg_tokens is not None and self.loss_agg_tokens < 1:
            raise ConfigError(f"algorithm.loss_agg_tokens={self.loss_agg_tokens} must be >= 1")
        if not self.norm_by_std and self.name != "grpo":
            raise ConfigError(f"algorithm.norm_by_std=false does nothing under algorithm.name="
                              f"{self.name} (only grpo divides by the group's std): drop it, or "
                              "use algorithm.name=grpo")
        if self.dynamic_sampling and self.group_size < 2:
            raise ConfigError("algorithm.dynamic_sampling=true drops groups whose rewards are "
                              "all equal, and algorithm.group_size=1 makes every group one "
                              "episode: set algorithm.group_size >= 2 (the recipe "
                              "algorithm=dapo does)")
        if self.dynamic_sampling_rounds < 0:
            raise ConfigError(f"algorithm.dynamic_sampling_rounds="
                              f"{self.dynamic_sampling_rounds} must be >= 0")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError(f"algorithm.overlong_buffer={self.overlong_buffer} and "
                              f"overlong_penalty={self.overlong_penalty} must be >= 0")

    def _check_ppo(self) -> None:
        """ppo's keys: GAE's lambda in [0, 1] and the critic's section valid under ppo;
        both refused at anything but their defaults under another estimator."""
        if self.name != "ppo":
            given = [("lam", self.lam, 1.0)] + [
                (f"critic.{f.name}", getattr(self.critic, f.name), f.default)
                for f in fields(CriticConfig)]
            for key, value, default in given:
                if value != default:
                    raise ConfigError(f"algorithm.{key}={value} does nothing under algorithm."
                                      f"name={self.name} (no critic): drop it, or use "
                                      "algorithm.name=ppo (the recipe algorithm=ppo)")
            return
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"algorithm.lam={self.lam}: use GAE's lambda in [0, 1] (1: "
                              "Monte-Carlo returns, 0: one-step TD)")
        self.critic._check()

    @property
    def off_policy_weights(self) -> Optional[tuple[str, float]]:
        """(mode, cap) of the off-policy weights, or None (off_policy=none)."""
        if self.off_policy == "none":
            return None
        return (self.off_policy, 2.0 if self.off_policy_cap is None else self.off_policy_cap)

    @property
    def chosen(self) -> tuple[str, ...]:
        """The fields given as "auto" and resolved at construction (module docstring): what the
        run's first lines say was chosen for the user. Not a field, so equal configs compare
        equal whoever chose; ``dataclasses.replace`` passes the resolved values on as given."""
        return self.__dict__.get("_chosen", ())

    def __post_init__(self):
        # "auto" resolved once, before any check reads the two fields; object.__setattr__
        # because the dataclass is frozen (this is its construction, not a later mutation)
        off_policy, old_logprobs = chosen_for(self.max_staleness, self.off_policy,
                                              self.old_logprobs)
        object.__setattr__(self, "_chosen", tuple(
            name for name in ("off_policy", "old_logprobs") if getattr(self, name) == AUTO))
        object.__setattr__(self, "off_policy", off_policy)
        object.__setattr__(self, "old_logprobs", old_logprobs)
        if self.old_logprobs not in ("rollout", "recompute"):
            raise ConfigError(f"algorithm.old_logprobs={self.old_logprobs!r}: use rollout, "
                              "recompute or auto")
        _at_least(self, "algorithm", 1, "group_size", "epochs", "micro_batch_size",
                  "micro_batch_tokens")
        if self.lr <= 0 or self.weight_decay < 0 or self.clip_grad < 0 or self.clip_eps < 0:
            raise ConfigError(f"algorithm.lr={self.lr} must be > 0 and weight_decay, clip_grad, "
                              "clip_eps >= 0")
        if isinstance(self.critic, dict):   # resolved.json and from_dict's callers' mappings
            object.__setattr__(self, "critic", CriticConfig(**self.critic))
        if self.name not in ESTIMATORS:
            raise ConfigError(f"algorithm.name={self.name!r}: use {', '.join(ESTIMATORS)}")
        if self.kl_mode not in ("off", "loss", "reward"):
            raise ConfigError(f"algorithm.kl_mode={self.kl_mode!r}: use off, loss or reward")
        self._check_menu()
        if self.kl_mode != "off" and self.kl_coef <= 0:
            raise ConfigError(f"algorithm.kl_mode={self.kl_mode} needs algorithm.kl_coef > 0")
        if self.kl_mode == "off" and self.kl_coef:
            raise ConfigError(f"algorithm.kl_coef={self.kl_coef} does nothing with "
                              "algorithm.kl_mode=off (no reference policy): set "
                              "algorithm.kl_mode=loss or reward, or drop the coefficient")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"algorithm.gamma={self.gamma}: use a discount in [0, 1]")
        if self.name in GROUPED and self.group_size < 2:
            raise ConfigError(f"algorithm.name={self.name} needs algorithm.group_size >= 2 (its "
                              "baseline is the group's)")
        if self.name not in ("reinforce_pp", "ppo") and self.gamma != 1.0:
            raise ConfigError(f"algorithm.gamma={self.gamma} does nothing under "
                              f"algorithm.name={self.name} (it scores whole episodes, no "
                              "per-turn returns): drop it, or use algorithm.name=reinforce_pp "
                              "or ppo")
        self._check_ppo()
        if self.entropy_coef < 0:
            raise ConfigError(f"algorithm.entropy_coef={self.entropy_coef} must be >= 0")
        if self.off_policy not in ("none", "tis", "decoupled"):
            raise ConfigError(f"algorithm.off_policy={self.off_policy!r}: use none, tis, "
                              "decoupled or auto")
        if self.off_policy_cap is not None and not self.off_policy_cap > 0:
            raise ConfigError(f"algorithm.off_policy_cap={self.off_policy_cap} must be > 0 (or "
                              "null: 2.0)")
        if self.off_policy_cap is not None and self.off_policy == "none":
            why = (f" (auto at algorithm.max_staleness={self.max_staleness})"
                   if "off_policy" in self.chosen else "")
            raise ConfigError(f"algorithm.off_policy_cap={self.off_policy_cap} does nothing "
                              f"with algorithm.off_policy=none{why}: set off_policy=tis or "
                              "decoupled, or drop the cap")
        if self.off_policy != "none" and self.old_logprobs != "recompute":
            raise ConfigError(f"algorithm.off_policy={self.off_policy} weights by pi_prox / "
                              "pi_behav, which needs the trainer's re-scoring: set "
                              "algorithm.old_logprobs=recompute, or drop it (auto chooses "
                              "recompute; with 'rollout' the ratio is 1 by definition)")
        if self.max_staleness < 0:
            raise ConfigError(f"algorithm.max_staleness={self.max_staleness} must be >= 0 "
                              "(0: synchronous)")
        if self.max_staleness and self.off_policy == "none":
            raise ConfigError(f"algorithm.max_staleness={self.max_staleness} trains tokens "
                              "sampled by older weights, which algorithm.off_policy=none leaves "
                              "uncorrected: drop algorithm.off_policy (auto: decoupled, with "
                              "old_logprobs=recompute) or set it to decoupled or tis")


