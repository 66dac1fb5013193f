"""The trainer's Hydra configuration composed outside the trainer, for launchers.

recipes/slurm/train.sbatch must know the run directory before torchrun starts: its stop file
lives there (trainer/stop.py), and the batch shell writes to it when Slurm signals. The run
directory is whatever ``recipes/config.yaml`` and the job's overrides make of ``run.output_dir``,
so the launcher asks the same composition the trainer does, without importing torch:

    python -m earl_megatron.config.compose --run-dir model=tiny run.output_dir=runs/x
    /abs/path/of/runs/x

Hydra's ``--config-name NAME`` (``-cn``) and ``--config-path DIR`` (``-cp``) are honoured as the
trainer's ``@hydra.main`` honours them (``sbatch train.sbatch --config-name qwen2.5-72b ...``).
A relative ``run.output_dir`` is resolved against the current directory, as the trainer resolves
it (srun starts torchrun in the batch script's directory). A composition error (unknown key,
missing recipe, another Hydra flag) is one line on stderr, ``configuration error: ...``, and exit
status 2.

The recipes' one resolver, ``${earl.if_moe:${.family},VALUE}``, is VALUE for a
mixture-of-experts family and null for a dense one: the tiny model's expert keys, so that
``model.family=qwen3_moe`` alone turns the tiny model into a tiny MoE (config/model.py). It is
registered when this module is imported (the trainer and the launchers import it).

``command_line_keys`` says which keys a command line's overrides set, so the trainer can tell
the user's values from the recipe's defaults (train.py ``apply_run_init``: run.init's model and
tokenizer replace the recipe's, never the user's).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

RECIPES = os.environ.get("EARL_RECIPES", str(Path(__file__).resolve().parents[2] / "recipes"))
"""The Hydra config directory (``$EARL_RECIPES`` overrides it): the trainer's and the launchers'."""


def _if_moe(family, value):
    from earl_megatron.config.model import MOE_FAMILIES
    return value if family in MOE_FAMILIES else None


def _register_resolvers() -> None:
    from omegaconf import OmegaConf
    if not OmegaConf.has_resolver("earl.if_moe"):
        OmegaConf.register_new_resolver("earl.if_moe", _if_moe)


_register_resolvers()

FLAGS = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path"}
TRAINER_DIR = Path(__file__).resolve().parents[1] / "train"
"""Where ``@hydra.main`` lives (the earl_megatron.train package's ``__init__``): a relative
--config-path starts here."""


def split_args(args: Sequence[str]) -> tuple[str, str, list[str]]:
    """(config name, config directory, overrides) of a trainer command line's arguments."""
    name, path, overrides = "config", RECIPES, []
    it = iter(args)
    for a in it:
        flag, eq, value = a.partition("=")
        if flag in FLAGS:
            if not eq:
                value = next(it, "")
            if not value:
                raise ValueError(f"{flag} needs a value")
            if FLAGS[flag] == "name":
                name = value
            else:   # as Hydra takes it: absolute, or relative to the trainer's module
                path = value if os.path.isabs(value) else str(TRAINER_DIR / value)
        elif a.startswith("-"):
            raise ValueError(f"{a}: only --config-name/-cn and --config-path/-cp are understood "
                             "here besides key=value overrides")
        else:
            overrides.append(a)
    return name, path, overrides


def command_line_keys(overrides: Sequence[str]) -> frozenset[str]:
    """The keys and config groups a command line's Hydra overrides set (``model.num_layers=2``,
    ``+rollout.tokenizer=x`` -> ``model.num_layers``, ``rollout.tokenizer``; ``model=qwen3-8b``
    -> ``model``; deletions ``~key`` set nothing): what the user chose, as opposed to what the
    recipe's defaults gave (train.py ``apply_run_init`` tells them apart with it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return frozenset(o.key_or_group for o in parsed if not o.is_delete())


def compose(args: Sequence[str]):
    """The trainer's configuration for command-line ``args`` (overrides and Hydra's config name
    and path flags), resolved (an OmegaConf DictConfig)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    name, path, overrides = split_args(args)
    with initialize_config_dir(config_dir=path, version_base=None):
        return hydra_compose(name, overrides=overrides)


def run_dir(args: Sequence[str]) -> Path:
    """The absolute run directory (``run.output_dir``) the trainer will use with ``args``."""
    return Path(os.path.abspath(str(compose(args).run.output_dir)))


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "--run-dir":
        print("usage: python -m earl_megatron.config.compose --run-dir [overrides...]",
              file=sys.stderr)
        return 2
    try:
        print(run_dir(argv[1:]))
    except Exception as e:  # noqa: BLE001 - Hydra's errors have several types; all are config
        print(f"configuration error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
