"""SGLang serving SmolLM2 on CPU: sampled tokens' logprobs equal Megatron-Core's within 1e-4 (fp32).

One trainer run with the user's command line (``run.init=DIR`` fills model.* and the tokenizer
from the model's directory; config/compose.py + train.configure, as ``python -m
earl_megatron.train`` does), world 1, rollout.engine=sglang:

    server   starts from config.json with dummy weights (--load-format dummy)
    push     the trainer's weights (the real ones, read from DIR) by the distributed update
    it 0     2 episodes over HTTP; the trainer re-scores them in its LOGPROB layout and records
             rollout_logprob_diff[_max]; TRAIN (Adam, lr 1e-4, an entropy bonus so the update is
             never zero even when every reward is equal); push the trained weights
    it 1     the same on the trained weights

Checked in metrics.jsonl: both iterations' ``rollout_logprob_diff_max`` < 1e-4 and each
iteration sampled from a newer weight version; the weight plan received no byte on any rank
(one rank holds the whole model; ``weight_sync_s`` recorded); iteration 0's update was not zero (grad_norm > 0:
Adam's first step moves every such parameter by ~lr, so stale weights on the server would show
in iteration 1's diff). Every episode is multi-turn, read back from <run>/samples: the
environment is the calculator in its JSON tool format (task description, tool messages) with
one change, ``PatientCalculator``: a reply with neither a tool call nor an answer (the base
model's usual reply) gets a reminder as a user turn instead of ending the episode, so turns 2
and 3 are sampled after the template's and the environment's tokens whatever the model says.

Needs EARL_SGLANG_VENV (``make test-real`` sets it); without it the test fails, never skips.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from earl_megatron.envs.base import StepResult
from earl_megatron.envs.tool_env import CalculatorEnv
from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
EPISODES, TURNS, ITERATIONS = 2, 3, 2
pytestmark = pytest.mark.timeout(1800)  # one server start: 35 s idle, minutes under load


class PatientCalculator(CalculatorEnv):
    """env=calculator, except that up to ``reminders`` turns with neither a tool call nor an
    answer get ``REMINDER`` (a user turn, reward 0) instead of ending the episode; the next
    such turn ends it as the calculator does (``invalid_penalty``, info["unparsable"])."""

    REMINDER = "Reply with a <tool_call> to the calculator, or with <answer>N</answer>."

    def __init__(self, reminders: int = TURNS - 1, **kwargs):
        super().__init__(**kwargs)
        self.reminders = self.left = int(reminders)

    def _reset(self, seed: int) -> str:
        self.left = self.reminders
        return super()._reset(seed)

    def _step(self, action: str) -> StepResult:
        res = super()._step(action)
        if res.done and res.info.get("unparsable") and self.left > 0:
            self.left -= 1
            return StepResult(self.REMINDER, 0.0, False, {"reminded": True})
        return res


def patient_calculator(**kwargs) -> PatientCalculator:
    """The factory ``env.name=test_real_sglang:patient_calculator`` names (envs/registry.py)."""
    return PatientCalculator(**kwargs)


def _train(cfg):
    from earl_megatron.train import run
    return run(cfg)


@pytest.fixture(scope="module")
def sglang_python() -> str:
    venv = os.environ.get("EARL_SGLANG_VENV")
    if not venv:
        pytest.fail("EARL_SGLANG_VENV is not set: run `make test-real` (it builds SGLang's CPU "
                    "venv with `make sglang` and sets the variable)", pytrace=False)
    python = Path(venv).expanduser() / "bin" / "python"
    if not python.is_file():
        pytest.fail(f"EARL_SGLANG_VENV={venv} has no bin/python: run `make sglang` (or `make "
                    "test-real`, which builds it)", pytrace=False)
    return str(python)


def test_sglang_logprobs_equal_megatron_on_real_weights(smollm2_dir, sglang_python, scratch_dir,
                                                        record):
    from omegaconf import OmegaConf

    from earl_megatron.config.compose import compose
    from earl_megatron.train import configure

    out = scratch_dir / "run"
    overrides = [
        f"run.init={smollm2_dir}", "rollout=sglang", "rollout.sglang_device=cpu",
        f"rollout.sglang_python={sglang_python}",
        # the planner sizes the server's pool as this fraction of the budget; the CPU server
        # applies it to host memory (docs/sglang.md): 1.3 GiB holds both weight copies and a pool
        "rollout.sglang_mem_fraction=0.08", "layout=static", "layout.memory_budget_gb=16",
        "layout.rollout=tp1", "layout.logprob=tp1", "layout.train=tp1",
        "env=calculator", f"env.name={__name__}:patient_calculator",
        "env.kwargs.tool_format=json", "env.kwargs.num_operands=2",
        f"rollout.episodes_per_iteration={EPISODES}", f"rollout.max_turns={TURNS}",
        "rollout.max_action_tokens=24", "rollout.temperature=1.0",
        "algorithm.lr=1e-4", "algorithm.entropy_coef=0.01", "algorithm.micro_batch_size=1",
        "cluster.server_start_timeout_s=600", "cluster.server_max_restarts=1",
        f"run.iterations={ITERATIONS}", f"run.output_dir={out}", "run.checkpoint_every=0",
        "run.eval_episodes=1", "run.live_view=false", f"run.samples_per_iteration={EPISODES}",
    ]
    cfg = configure(OmegaConf.to_container(compose(overrides), resolve=True), overrides)
    assert cfg.rollout.tokenizer == str(smollm2_dir)   # run.init alone gave the tokenizer
    run_distributed(_train, 1, cfg, timeout=1700,
                    collective_timeout_s=cfg.cluster.collective_timeout_s)

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    lines = [x for x in lines if "iteration" in x]
    assert [x["iteration"] for x in lines] == list(range(ITERATIONS))
    versions = [x["rollout_weight_version"] for x in lines]
    assert len(set(versions)) == ITERATIONS, versions   # each rollout on a newer push
    record("sglang server start s", f"{lines[0]['rollout_server_restart_s']:.1f}")
    for x in lines:
        it = x["iteration"]
        record(f"sglang iteration {it} s", {k: round(v, 1) for k, v in x["seconds"].items()})
        record(f"sglang rollout_logprob_diff it{it}", x["rollout_logprob_diff"])
        record(f"sglang rollout_logprob_diff_max it{it}", x["rollout_logprob_diff_max"])
        record(f"sglang weight_sync_s it{it}", x["weight_sync_s"])
        assert x["rollout_engine"] == "sglang"
        assert 0 < x["rollout_logprob_diff"] <= x["rollout_logprob_diff_max"] < TOL, x
        # world 1: the leader holds the whole model, the weight plan moves nothing between
        # ranks (the all-gather it replaced pickled the 538 MB through all_gather_object)
        assert x["weight_sync_bytes_in_max"] == x["weight_sync_bytes_in_leader"] == 0, x
    assert lines[0]["grad_norm"] > 0, lines[0]   # the weights iteration 1 sampled had changed

    from earl_megatron.trainer.samples import read_samples
    for it in range(ITERATIONS):
        samples = read_samples(out, it)
        assert len(samples) == EPISODES
        turns = [s["turns"] for s in samples]
        record(f"sglang episodes it{it}: turns, policy tokens",
               f"{turns}, {[s['policy_tokens'] for s in samples]}")
        assert min(turns) >= 2, [(s["turns"], s["actions"]) for s in samples]
