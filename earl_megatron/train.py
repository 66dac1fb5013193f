"""The main job: agentic RL with a layout per stage, SPMD under torchrun.

    torchrun --standalone --nproc-per-node 4 -m earl_megatron.train run.iterations=20 \\
        layout=static layout.train=tp2

Hydra composes recipes/config.yaml with the command-line overrides; the result is converted once
to ``TrainConfig`` (frozen) and saved with the run as resolved.json. Bad configuration (unknown
keys, an unknown environment, a layout the model cannot take, a model that fits no layout, a
node count that does not match the world) stops here, before any model is built: one line
(rank 0) and exit status 2, as does a damaged checkpoint (run.init or a resume). Megatron's known
warnings are filtered before the imports that print them (earl_megatron/quiet.py). A run stopped
at a safe point (trainer/stop.py: SIGTERM, the sbatch stop file) exits 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from earl_megatron.config.train import ConfigError, TrainConfig

RECIPES = os.environ.get("EARL_RECIPES",
                         str(Path(__file__).resolve().parents[1] / "recipes"))


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
        tok = AutoTokenizer.from_pretrained(name)
    if len(tok) > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {name!r} has {len(tok)} tokens but model.vocab_size="
                          f"{cfg.model.vocab_size}; raise model.vocab_size")
    return tok


def validate(cfg: TrainConfig, world: int) -> None:
    """Everything that can be checked before a model exists."""
    from earl_megatron.envs import list_envs
    from earl_megatron.plan.layout import InvalidLayoutError, ParallelLayout

    if cfg.env.name not in list_envs():
        raise ConfigError(f"env.name={cfg.env.name!r} is not a registered environment; known: "
                          f"{list(list_envs())}")
    if cfg.rollout.engine == "sglang":
        from earl_megatron.trainer.sglang_rollout import check_sglang_python
        check_sglang_python(cfg.rollout.sglang_python)
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
    for stage in ("rollout", "logprob", "train"):
        text = cfg.layout.static(stage)
        if text is not None:
            try:
                lay = ParallelLayout.parse(text, world_size=world, model=cfg.model)
            except InvalidLayoutError as e:
                raise ConfigError(f"layout.{stage}={text}: {e}") from e
            if stage == "rollout" and lay.cp != 1:
                raise ConfigError(f"layout.rollout={text}: rollout decodes with cp=1")
            if stage == "rollout" and lay.pp != 1 and cfg.rollout.engine == "sglang":
                raise ConfigError(f"layout.rollout={text}: SGLang servers take tp x dp "
                                  "layouts (pp=1); use e.g. tp2 or dp2")
    if cfg.rollout.episodes_per_iteration < world:
        raise ConfigError(f"rollout.episodes_per_iteration={cfg.rollout.episodes_per_iteration} "
                          f"< world size {world}: some dp rank would train on nothing")


def run(cfg: TrainConfig) -> list[dict]:
    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()  # before the imports below print them
    from earl_megatron.runtime.dist import init_distributed
    from earl_megatron.trainer.runner import Trainer

    rank, world = init_distributed()
    validate(cfg, world)
    # Hydra configures the root logger at INFO; Megatron logs every optimizer and DDP setup
    import logging
    logging.disable(logging.INFO)
    torch.set_num_threads(1)
    out = Path(cfg.run.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resolved.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    backend = contextlib.nullcontext()
    if not torch.cuda.is_available():
        from earl_megatron.runtime.cpu_backend import cpu_backend
        backend = cpu_backend()
    with backend:
        return Trainer(cfg, make_tokenizer(cfg)).train()


def _fail(kind: str, e: Exception) -> None:
    """One line from rank 0 (every rank raises the same error), exit status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{kind}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def main() -> None:
    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()
    import hydra
    from omegaconf import OmegaConf

    from earl_megatron.runtime.io_errors import CheckpointError

    @hydra.main(config_path=RECIPES, config_name="config", version_base=None)
    def _entry(dcfg) -> None:
        try:
            cfg = TrainConfig.from_dict(OmegaConf.to_container(dcfg, resolve=True))
        except ConfigError as e:
            _fail("configuration error", e)
        t0 = time.time()
        try:
            run(cfg)
        except ConfigError as e:
            _fail("configuration error", e)
        except CheckpointError as e:
            _fail("checkpoint error", e)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"done in {time.time() - t0:.0f} s; metrics in {cfg.run.output_dir}")

    _entry()


if __name__ == "__main__":
    main()
