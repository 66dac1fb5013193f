"""What changing the rollout layout costs when ROLLOUT runs on inference servers (SGLang).

The trainer's SGLang servers (trainer/sglang_servers.py) are one per rollout dp replica with
``--tp-size`` = the layout's tp. A training rollout planned in another (tp, dp) stops them,
starts new ones and pushes the current weights before the first request::

    servers' layout  ->  planned layout     servers' extra cost before the rollout
    TP2 x DP2        ->  TP2 x DP2          0                       (the servers stay)
    TP2 x DP2        ->  TP4 x DP1          restart(tp4) + push     (stop, start, push)
    none yet         ->  TP4 x DP1          restart(tp4) + push     (every candidate pays one)

- restart(tp): the seconds measured for the last (re)start of servers with this tp for this
  model (``ProfileTable.restart_seconds``, keyed by (``model_key(model)``, tp); the trainer
  records every start), else ``default_s`` (``rollout.sglang_restart_s``).
- push: one extra weight push into the fresh servers (the push after every TRAIN step happens
  anyway): every rank gathers the full weights and each replica's first rank broadcasts them
  to its server, 2 x the model's bytes over the intra-node link (an ASSUMPTION; 0.3 s for a
  72B bf16 model over NVLink, next to a restart of a minute or more).

The servers' layout is the last layout the selector chose for ROLLOUT (training rollouts always
start the servers in the planned layout; evaluations play on them as they stand). This cost is
added to the Megatron reshard of the policy into the rollout layout (the trainer still moves
its own copy there, to re-score the episodes), so the selector's hysteresis compares a
candidate's stage seconds + reshard + restart against the incumbent's, which restarts nothing.

Pure: frozen values and functions, no torch.
"""

from __future__ import annotations

from typing import Optional

from earl_megatron.config.model import ModelConfig
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.plan.profile_table import ProfileTable
from earl_megatron.plan.specs import ClusterSpec, TrainOptions
from earl_megatron.plan.tensor_table import tensor_table


def model_key(model: ModelConfig) -> str:
    """The model's name in the profile table's restart entries: its shape and dtype (what a
    server start loads and allocates), e.g. ``llama-L4-h64-f128-a8-g4-d8-v128-float32``."""
    m = model
    return (f"{m.family}-L{m.num_layers}-h{m.hidden_size}-f{m.ffn_hidden_size}-"
            f"a{m.num_attention_heads}-g{m.num_query_groups}-d{m.head_dim}-v{m.vocab_size}-"
            f"{m.params_dtype}")


def restart_seconds(model: ModelConfig, tp: int, profile: Optional[ProfileTable],
                    default_s: float) -> float:
    """Measured seconds of a server (re)start with this tp for this model, else ``default_s``."""
    measured = profile.restart_seconds(model_key(model), tp) if profile is not None else None
    return default_s if measured is None else measured


def push_seconds(model: ModelConfig, cluster: ClusterSpec,
                 train_opts: TrainOptions = TrainOptions()) -> float:
    """One weight push into fresh servers: gather the full model, broadcast it to the server."""
    full = tensor_table(model).elements_on(0, 1, 1) * train_opts.param_bytes(model)
    return 2 * full / cluster.intra_node_bandwidth


def server_switch_seconds(model: ModelConfig, cluster: ClusterSpec,
                          servers: Optional[ParallelLayout], dst: ParallelLayout,
                          profile: Optional[ProfileTable], default_s: float,
                          train_opts: TrainOptions = TrainOptions()) -> float:
    """Seconds the servers add before a rollout in ``dst`` when they run in ``servers`` (None:
    none running): 0 if (tp, dp) is unchanged, else restart(dst.tp) + one push."""
    if default_s < 0:
        raise ValueError(f"default restart seconds must be >= 0, got {default_s} (set "
                         "rollout.sglang_restart_s)")
    if servers is not None and (servers.tp, servers.dp) == (dst.tp, dst.dp):
        return 0.0
    return restart_seconds(model, dst.tp, profile, default_s) + push_seconds(model, cluster,
                                                                             train_opts)
