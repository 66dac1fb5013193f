"""The main job: agentic RL with a layout per stage, SPMD under torchrun.

    torchrun --standalone --nproc-per-node 4 -m earl_megatron.train run.iterations=20 \\
        layout=static layout.train=tp2

Hydra composes recipes/config.yaml with the command-line overrides; the result is converted once
to ``TrainConfig`` (frozen) and saved with the run as resolved.json. With ``run.init=DIR`` the
checkpoint is the model (``apply_run_init``): model.* from its config, the tokenizer from its
directory, and the model.* keys the command line sets (Hydra's task overrides, as opposed to the
recipe's defaults) checked against it. Bad configuration (unknown
keys, an unknown environment, a layout the model cannot take, a model that fits no layout, a
node count that does not match the world, a missing sft.data file, a missing tokenizer, a run.init
of an architecture the project does not convert) stops here, before any model is built: one line
(rank 0) and exit status 2, as does a damaged checkpoint (run.init or a resume) and a model no
layout fits (with the config keys that would make one fit, ``layout_fix``). Megatron's known
warnings are filtered before the imports that print them (earl_megatron/quiet.py). A run stopped
at a safe point (trainer/stop.py: SIGTERM, the sbatch stop file) exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Collection, Optional

import torch
import torch.distributed as dist

from earl_megatron.config.compose import RECIPES, command_line_keys
from earl_megatron.config.conversion import init_model
from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.reporting import _fail, layout_fix, reporting_errors  # noqa: F401 (re-exported)
from earl_megatron.stages import STAGE_NAMES

BUILTIN_TOKENIZERS = ("game", "ascii", "tool")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory holding any one of these is one transformers' AutoTokenizer can try to load."""


def _holding_tokenizer(name: str) -> Optional[Path]:
    """``name`` itself or the ``hf/`` folder of a converted checkpoint (the converter copies the
    tokenizer files there), whichever holds a tokenizer file; None: neither."""
    from earl_megatron.runtime.checkpoint import HF_SUBDIR

    p = Path(name)
    return next((d for d in (p, p / HF_SUBDIR)
                 if any((d / f).is_file() for f in TOKENIZER_FILES)), None)


def tokenizer_dir(name: str) -> Path:
    """The HF directory ``rollout.tokenizer`` names: the directory itself, or the ``hf/`` folder
    of a converted checkpoint, so ``rollout.tokenizer`` (and run.init's tokenizer,
    ``apply_run_init``) works with either kind of run.init."""
    from earl_megatron.runtime.checkpoint import HF_SUBDIR

    p = Path(name)
    found = _holding_tokenizer(name)
    if found is not None:
        return found
    if not p.is_dir():
        raise ConfigError(f"rollout.tokenizer={name} is not a directory; use "
                          f"{', '.join(BUILTIN_TOKENIZERS)} or the model's HF directory")
    raise ConfigError(f"rollout.tokenizer={name} holds no tokenizer file (none of "
                      f"{', '.join(TOKENIZER_FILES)}, there or in its {HF_SUBDIR}/ folder); point "
                      "rollout.tokenizer at the model's HF directory")


def make_tokenizer(cfg: TrainConfig):
    from earl_megatron.rollout.tokenizer import GAME_ALPHABET, char_tokenizer, tool_tokenizer

    name = cfg.rollout.tokenizer
    if name == "game":
        tok = char_tokenizer(GAME_ALPHABET)
    elif name == "ascii":
        tok = char_tokenizer()
    elif name == "tool":
        tok = tool_tokenizer()
    else:
        from transformers import AutoTokenizer
        path = tokenizer_dir(name)
        try:
            tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:  # a corrupt or partial tokenizer directory
            why = f"no key {e} in its files" if isinstance(e, KeyError) else \
                (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"rollout.tokenizer={name}: transformers cannot load a tokenizer "
                              f"from {path} ({why}); copy the model's tokenizer files again"
                              ) from None
    if len(tok) > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {name!r} has {len(tok)} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; raise model.vocab_size")
    return tok


def validate(cfg: TrainConfig, world: int) -> None:
    """Everything that can be checked before a model exists."""
    from earl_megatron.envs.registry import UnknownEnvError, env_factory
    from earl_megatron.plan.layout import InvalidLayoutError, ParallelLayout
    from earl_megatron.plan.rollout_rules import rollout_layout_problem

    if cfg.env.name == "agent":
        _check_agent(cfg, world)
    else:
        try:
            env_factory(cfg.env.name)
        except UnknownEnvError as e:
            raise ConfigError(f"env.name={cfg.env.name!r}: {e}") from None
    if cfg.rollout.engine == "sglang":
        from earl_megatron.rollout.sglang_launch import check_sglang_python
        check_sglang_python(cfg.rollout.sglang_python)
    _check_inputs(cfg)
    from earl_megatron.trackers import check_installed
    check_installed(cfg.run.loggers)   # a tracker's package: refused before any rank starts
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    per_node = cfg.cluster.devices_per_node
    if per_node is not None and per_node != local:
        raise ConfigError(f"cluster.devices_per_node={per_node} but torchrun started {local} "
                          "ranks per node; pass --nproc-per-node "
                          f"{per_node} or cluster.devices_per_node=null")
    if cfg.cluster.nodes * local != world:
        raise ConfigError(f"cluster.nodes={cfg.cluster.nodes} x {local} ranks per node != world "
                          f"size {world}; pass cluster.nodes=$SLURM_NNODES (the sbatch script "
                          "does)")
    r = cfg.rollout
    if r.placement == "split" and cfg.layout.mode == "static":   # each pool's layout
        from earl_megatron.trainer.split import split_pools
        split_pools(cfg, world)
        return
    if r.placement in ("auto", "split"):    # the plan checks the pools at the start
        if world < 2:
            raise ConfigError(f"rollout.placement={r.placement} splits the world into a rollout "
                              "and a train pool: run on at least 2 ranks")
        if r.pool_ranks is not None and not 1 <= r.pool_ranks < world:
            raise ConfigError(f"rollout.pool_ranks={r.pool_ranks} on {world} ranks must leave "
                              f"both pools at least one rank (1 .. {world - 1})")
        return
    if cfg.rollout.placement != "colocated":
        raise ConfigError(f"rollout.placement={cfg.rollout.placement!r}")
    for stage in STAGE_NAMES:
        text = cfg.layout.static(stage)
        if text is not None:
            try:
                lay = ParallelLayout.parse(text, world_size=world, model=cfg.model)
            except InvalidLayoutError as e:
                raise ConfigError(f"layout.{stage}={text}: {e}") from e
            problem = stage == "rollout" and rollout_layout_problem(lay, cfg.rollout.engine)
            if problem:
                raise ConfigError(f"layout.rollout={text}: {problem}")
    if cfg.rollout.episodes_per_iteration < world:
        raise ConfigError(f"rollout.episodes_per_iteration={cfg.rollout.episodes_per_iteration} "
                          f"< world size {world}: some dp rank would train on nothing")


def _check_agent(cfg: TrainConfig, world: int) -> None:
    """env.name=agent: the tasks file reads, the entry and reward import (env=verifiers: the
    environment loads, with a dataset), the agents extra is installed; each problem one
    ConfigError."""
    from earl_megatron.agents.programs import AgentConfigError
    from earl_megatron.trainer.agent_rollout import agent_program, agent_spec

    try:
        agent_program(agent_spec(cfg), cfg.rollout.max_turns)
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except (AgentConfigError, ValueError) as e:
        raise ConfigError(str(e)) from None
    except ImportError as e:
        raise ConfigError(f"env.name=agent: {e}; pip install 'earl_megatron[agents]'") from None
    if cfg.env.eval_opponents:
        raise ConfigError(f"env.eval_opponents={list(cfg.env.eval_opponents)}: agent tasks "
                          "have no opponents; set env.eval_opponents=[] (evaluations then play "
                          "the tasks, greedy and sampled)")
    if cfg.sft.steps and cfg.sft.data is None:
        raise ConfigError("sft.steps > 0 with env.name=agent needs sft.data=PATH (chat "
                          "trajectories): agent programs have no scripted expert")
    if cfg.model.num_experts and cfg.rollout.engine == "embedded" and \
            cfg.layout.mode == "static":   # auto layouts plan ep = 1 rollouts themselves
        from earl_megatron.plan.layout import ParallelLayout
        rollout = cfg.layout.static("rollout")
        if ParallelLayout.parse(rollout, world_size=world, model=cfg.model).ep > 1:
            raise ConfigError(
                f"env.name=agent with an MoE model on the embedded engine: layout.rollout="
                f"{rollout} has ep > 1; use a layout.rollout with ep=1, layout=auto (which "
                "plans ep=1 rollouts), or rollout.engine=sglang: embedded replicas with ep > 1 "
                "decode in lockstep, which agent programs' own timing cannot follow")


def _check_inputs(cfg: TrainConfig) -> None:
    """The environment's kwargs and the files the run reads (sft.data or the expert, the
    tokenizer, run.init's config) or would overwrite (run.resume=false), checked on every
    rank before any model or group exists: each problem is one ConfigError naming its key."""
    from earl_megatron.envs import make_env
    for opp in (None, *cfg.env.eval_opponents) if cfg.env.name != "agent" else ():
        kwargs = dict(cfg.env.kwargs) if opp is None else {**cfg.env.kwargs, "opponent": opp}
        try:
            make_env(cfg.env.name, **kwargs)
        except (TypeError, ValueError) as e:
            if opp is None:
                raise ConfigError(f"env.kwargs of env.name={cfg.env.name}: {e}") from None
            raise ConfigError(f"env.eval_opponents={list(cfg.env.eval_opponents)} of env.name="
                              f"{cfg.env.name}: opponent {opp!r}: {e} (an environment without "
                              "opponents takes env.eval_opponents=[])") from None
    from earl_megatron.trainer.warm_start import TraceSource, check_warm_start
    check_warm_start(cfg.sft, TraceSource(cfg.env.name, dict(cfg.env.kwargs), cfg.run.seed))
    if not cfg.run.resume:   # resume.start's refusal, made before any rank starts
        from earl_megatron.trainer.segments import earlier_run
        if (refused := earlier_run(cfg.run.output_dir)) is not None:
            raise ConfigError(refused)
    if cfg.rollout.tokenizer not in BUILTIN_TOKENIZERS:
        tokenizer_dir(cfg.rollout.tokenizer)
    if cfg.run.init is not None:
        # a TrainConfig built in code counts as all explicit: every field checked (a command
        # line's went through apply_run_init, which filled them from the checkpoint)
        found = init_config(cfg.run.init)
        _adapter_lora(cfg.run.init, found, init_model(found, dataclasses.asdict(cfg.model),
                                                      cfg.run.init), False)


def init_config(init: str):
    """The ModelConfig of the checkpoint ``run.init`` names (config.json only, no tensors);
    each problem one ConfigError (missing, a PEFT adapter, an architecture not converted) or
    CheckpointError (damaged, neither kind of checkpoint) naming run.init."""
    from earl_megatron.runtime.io_errors import CheckpointError
    from earl_megatron.weights.convert import read_model_config
    if not Path(init).exists():
        raise ConfigError(f"run.init={init} does not exist; pass an HF directory or a "
                          "checkpoint of tools/convert_hf_to_mcore.py, or run.init=null "
                          "(a random init from run.seed)")
    from earl_megatron.weights.peft_import import adapter_spec, is_peft_adapter
    if is_peft_adapter(init):   # its base's model, with the adapter's model.lora
        try:
            adapter, spec = adapter_spec(init, read_model_config)
        except ValueError as e:
            raise ConfigError(f"run.init={init}: {e}") from None
        return init_config(str(adapter.base)).with_(lora=spec)
    try:
        return read_model_config(init)
    except CheckpointError as e:  # damaged or neither kind: reported as a checkpoint error
        raise CheckpointError(f"run.init={init}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"run.init={init}: its config.json has no {e.args[0]!r}; copy the "
                          "model's config.json again") from None
    except ValueError as e:  # an architecture or a feature the project does not convert
        raise ConfigError(f"run.init={init}: {e}") from None


def apply_run_init(d: dict, keys: Collection[str] = ()) -> dict:
    """The composed config ``d`` (a plain dict) of a run that starts from ``run.init``, with
    ``keys`` the command line set (config/compose.py ``command_line_keys``):

    - model.* is the checkpoint's config; the recipe's model values are not used. A model.*
      key on the command line (or every field, for a ``model=NAME`` group there) must match
      the checkpoint, except ``INIT_MAY_DIFFER`` (config/conversion.py ``init_model``).
      model.lora (recipe or command line) is the run's: adapters over the checkpoint.
    - rollout.tokenizer is run.init's directory when it holds a tokenizer (its ``hf/`` folder
      for a converted checkpoint) and the command line does not set rollout.tokenizer; else
      the recipe's value stays.
    - a leading ``~`` of run.init is expanded.
    Without run.init, ``d`` is returned as it is. Reads config.json only."""
    run = d.get("run") or {}
    if not run.get("init"):
        return d
    init = os.path.expanduser(str(run["init"]))
    model = d.get("model") or {}
    # a nested key (model.lora.rank) names its section; model.lora is the run's, never the
    # checkpoint's (config/conversion.py init_model): the recipe's section counts too
    given = list(model) if "model" in keys else [k.split(".")[1] for k in keys
                                                  if k.startswith("model.")]
    given = list(dict.fromkeys(given + (["lora"] if "lora" in model else [])))
    checkpoint = init_config(init)
    found = _adapter_lora(init, checkpoint, init_model(checkpoint, {k: model.get(k)
                                                                    for k in given}, init),
                          model.get("lora") is not None)
    out = {**d, "model": dataclasses.asdict(found), "run": {**run, "init": init}}
    from earl_megatron.weights.peft_import import model_dir
    # an adapter without a tokenizer of its own: its base's
    source = init if _holding_tokenizer(init) is not None else model_dir(init)
    if "rollout.tokenizer" not in keys and _holding_tokenizer(source) is not None:
        out["rollout"] = {**(d.get("rollout") or {}), "tokenizer": source}
    return out


def _adapter_lora(init: str, checkpoint, model, loose: bool):
    """``model`` (init_model's over ``checkpoint``, init_config's), whose lora must be the PEFT
    adapter's when run.init is one. ``loose``: a section with rank 0 (a recipe's default) takes
    the adapter's."""
    from earl_megatron.weights.peft_import import is_peft_adapter
    if not is_peft_adapter(init):
        return model
    spec = checkpoint.lora
    if model.lora == spec or (loose and not model.lora.enabled):
        return model.with_(lora=spec)
    raise ConfigError(f"model.lora={model.lora} differs from the PEFT adapter run.init={init} "
                      f"({spec}): drop model.lora.* to take the adapter's")


def run(cfg: TrainConfig) -> list[dict]:
    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()  # before the imports below print them
    from earl_megatron.runtime.dist import init_distributed, world_record
    from earl_megatron.trainer.runner import Trainer

    rank, world = init_distributed(cfg.cluster.collective_timeout_s, cfg.cluster.world_backend)
    validate(cfg, world)
    tokenizer = make_tokenizer(cfg)  # loaded before anything is written: a bad one is 1 line
    # Hydra configures the root logger at INFO; Megatron logs every optimizer and DDP setup
    import logging
    logging.disable(logging.INFO)
    torch.set_num_threads(1)
    out = Path(cfg.run.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resolved.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        (out / "world.json").write_text(json.dumps(world_record(), indent=1))
    backend = contextlib.nullcontext()
    if not torch.cuda.is_available():
        from earl_megatron.runtime.cpu_backend import cpu_backend
        backend = cpu_backend()
    from earl_megatron.trainer.handoff import HandoffFailed
    with backend:
        try:
            return Trainer(cfg, tokenizer).train()
        except HandoffFailed as e:   # split: one line naming the limit and the checkpoint
            _fail("handoff error", e)


def configure(d: dict, overrides: Collection[str] = ()) -> TrainConfig:
    """The TrainConfig of a composed config ``d`` (a plain dict) and the command line's Hydra
    ``overrides``, which say what the user set: run.init fills what they did not
    (``apply_run_init``)."""
    return TrainConfig.from_dict(apply_run_init(d, command_line_keys(overrides)))


def hydra_entry(body) -> None:
    """Compose the recipes with the command line (Hydra), convert to TrainConfig (one line and
    exit 2 on bad input) and call ``body(cfg)`` with its errors reported the same way: the
    command line of every entry point (this module, serve.py)."""
    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()
    import hydra
    from omegaconf import OmegaConf

    @hydra.main(config_path=RECIPES, config_name="config", version_base=None)
    def _entry(dcfg) -> None:
        from hydra.core.hydra_config import HydraConfig
        cfg = reporting_errors(configure, OmegaConf.to_container(dcfg, resolve=True),
                               list(HydraConfig.get().overrides.task))
        reporting_errors(body, cfg)

    _entry()


def _train(cfg: TrainConfig) -> None:
    t0 = time.time()
    try:
        run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"done in {time.time() - t0:.0f} s; metrics in {cfg.run.output_dir}")


def main() -> None:
    hydra_entry(_train)

