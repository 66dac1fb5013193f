"""Evaluation: win rate (and the tool metrics) of the policy on held-out seeds, greedy and sampled.

Every rank of the pool that evaluates calls ``evaluate`` (the world, colocated; split
placement's train pool). The environments are the evaluation stream of earl_megatron/seeds.py
(never a training game) and the sampling seed is fixed (``EVAL_SAMPLE_SEED``), so the start and
the end of a run play the same games with the same random numbers: they compare policies. The
engine decodes with cp = 1, so the policy evaluates in its layout with the cp ranks spent on dp
(plan/rollout_rules.py ``decode_layout``). "sampled" plays the stochastic policy at the rollout
temperature (what training optimises); "greedy" plays its argmax. An environment without
opponents (the calculator) is evaluated under its own name. A stop request abandons the
evaluation at its next turn: the result is None and nothing is recorded.

Progress (``progress``: rank 0's live view): (what plays now, episodes ended, episodes) over the
whole evaluation, counted on this rank's replica (it plays its block of every opponent and mode
while the other replicas play theirs), reported before the agent loop's first turn, after each
of its turns and after every play. Nothing is exchanged for it: the counts are this rank's own.
"""

from __future__ import annotations

from typing import Callable, Optional

from earl_megatron.config.train import TrainConfig
from earl_megatron.envs.tool_env import tool_metrics
from earl_megatron.plan.rollout_rules import decode_layout
from earl_megatron.rollout.agent_loop import RolloutAbandoned
from earl_megatron.seeds import EVAL_SAMPLE_SEED, evaluation_seeds
from earl_megatron.trainer.model_pair import ModelPair
from earl_megatron.trainer.record import gather_by_sample, tool_row
from earl_megatron.trainer.stop import StopControl


def evaluate(cfg: TrainConfig, rollout, stop: StopControl, models: ModelPair,
             after_play: Callable[[], None],
             progress: Optional[Callable[[str, int, int], None]] = None) -> Optional[dict]:
    """``{"<opponent>/<greedy|sampled>": {"win_rate", "mean_reward", tool metrics}}``; None when
    told to stop meanwhile. ``after_play`` runs after every play (the trainer records server
    starts there: the first evaluation may start the servers); ``progress``: module doc."""
    policy = models.policy_in(decode_layout(models.policy.layout))
    seeds = evaluation_seeds(cfg.run.seed, cfg.run.eval_episodes)
    plays = [(opp, mode, temp) for opp in cfg.env.eval_opponents or (None,)
             for mode, temp in (("greedy", 0.0), ("sampled", cfg.rollout.temperature))]
    show = progress or (lambda what, done, total: None)
    block = 0   # this replica's episodes per play: known from its first report (0: not yet)
    out = {}
    for i, (opp, mode, temp) in enumerate(plays):
        what = f"{opp or cfg.env.name}/{mode}, play {i + 1}/{len(plays)}"

        def turn(ended: int, episodes: int, i: int = i, what: str = what) -> None:
            nonlocal block
            block = episodes
            show(what, i * block + ended, len(plays) * block)

        show(what, i * block, len(plays) * block)
        try:
            ids, eps = rollout.play(policy, seeds, temperature=temp,
                                    sample_seed=EVAL_SAMPLE_SEED, opponent=opp,
                                    evaluation=True, should_stop=stop.replica_should_stop,
                                    progress=turn)
        except RolloutAbandoned:
            ids, eps = [], []
        if ids:     # every episode of the replica ended (agent programs report only this)
            turn(len(ids), len(ids))
        after_play()
        if stop.pool_should_stop():  # every rank of the pool: none once stopping
            return None
        by_id = gather_by_sample(ids, [(e.info.get("outcome"), e.reward, tool_row(e))
                                       for e in eps])
        res = {"win_rate": sum(o == "win" for o, _, _ in by_id.values()) / len(by_id),
               "mean_reward": sum(r for _, r, _ in by_id.values()) / len(by_id)}
        tool = [t for _, _, t in by_id.values() if t is not None]
        if tool:
            res.update(tool_metrics(tool))
        out[f"{opp or cfg.env.name}/{mode}"] = res
    return out
