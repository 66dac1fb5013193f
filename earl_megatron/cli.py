"""``earl``: one command that checks the configuration once, then launches (torchtune's ``tune run``).

    earl train --nproc-per-node 4 [torchrun options] [Hydra overrides]
    earl plan --model qwen2.5-72b --nodes 16 ...          (tools/plan_layouts.py)
    earl convert hf-to-mcore HF_DIR OUT | mcore-to-hf CKPT OUT    (tools/convert_*.py)
                 [--merged] [--base-model HF]  (LoRA: a PEFT adapter, or merged)
    earl view RUN_DIR [--port P] [--host H]               a web page of a run (viewer/)
    earl serve run.init=DIR [overrides]                   OpenAI's API over a checkpoint (serve.py)

``earl train`` composes the trainer's configuration in this process (config/compose.py, the
same composition the trainer's ``@hydra.main`` makes) and runs everything ``train.validate``
checks before any rank exists: a bad key, value, file, layout or node count is one line and exit
status 2 whatever the rank count, and no worker starts. Then it runs torchrun's own launcher in
this process (``torch.distributed.run.run``, the code behind the ``torchrun`` command, so its
options, rendezvous and signal forwarding are torchrun's). Each worker's stderr goes to
``<run.output_dir>/logs/`` (``--log-dir``/``--redirects``/``--tee`` given by the user win): the
console keeps rank 0's live view, and a failing run ends with one line naming the rank, how it
ended, its own last error (``last_error``: the exception line of its last traceback, never
Hydra's ``HYDRA_FULL_ERROR`` hint), and its log file, instead of torchrun's failure box.
Plain ``torchrun -m earl_megatron.train`` keeps working; this wraps it.

Arguments: ``key=value`` (and ``+key=value``, ``~key``) are Hydra overrides, as are
``--config-name``/``-cn`` and ``--config-path``/``-cp`` with their values; every other dashed
argument is torchrun's, with its value when it takes one (``launcher_and_trainer_args``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from earl_megatron.config.compose import FLAGS

TOOLS = Path(__file__).resolve().parents[1] / "tools"
"""The repository's thin CLIs (``earl plan``, ``earl convert``), beside recipes/."""

TRAINER_MODULE = "earl_megatron.train"
CONVERSIONS = {"hf-to-mcore": "convert_hf_to_mcore.py", "mcore-to-hf": "convert_mcore_to_hf.py"}
USAGE = ("usage: earl train [torchrun options] [overrides] | earl plan [options] | "
         "earl convert {hf-to-mcore,mcore-to-hf} SRC OUT | earl view RUN_DIR [--port P] | "
         "earl serve run.init=DIR [overrides]")

SERVE_PORT = 8000
"""``earl serve``'s port unless rollout.agent_port is given (a chat client's usual one)."""


def serve(argv: Sequence[str]) -> int:
    """``python -m earl_megatron.serve`` with the overrides, on port ``SERVE_PORT`` unless
    rollout.agent_port is among them (Hydra parses ``sys.argv``)."""
    from earl_megatron import serve as serving

    args = list(argv)
    if not any(a.lstrip("+").startswith("rollout.agent_port=") for a in args):
        args.append(f"rollout.agent_port={SERVE_PORT}")
    sys.argv = [serving.__file__, *args]
    serving.main()
    return 0


def _flag_arity() -> dict[str, bool]:
    """Each torchrun option string -> whether it takes a value (from torchrun's own parser)."""
    from torch.distributed.run import get_args_parser

    out = {}
    for action in get_args_parser()._actions:
        for opt in action.option_strings:
            out[opt] = action.nargs != 0
    return out


def launcher_and_trainer_args(argv: Sequence[str], arity: Optional[dict[str, bool]] = None
                              ) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, the trainer's) of an ``earl train`` command line (module doc).
    ValueError names an argument that is neither."""
    arity = _flag_arity() if arity is None else arity
    launcher: list[str] = []
    trainer: list[str] = []
    it = iter(argv)
    for a in it:
        flag, eq, _ = a.partition("=")
        if flag in FLAGS:
            trainer.append(a)
            if not eq:
                trainer.append(next(it, ""))
        elif a.startswith("-"):
            if flag not in arity:
                raise ValueError(f"{a}: not a torchrun option (torchrun --help) nor Hydra's "
                                 f"--config-name/--config-path; overrides are key=value")
            if flag in ("-m", "--module", "--no-python", "--no_python", "--run-path",
                        "--run_path"):
                raise ValueError(f"{a}: earl train always runs -m {TRAINER_MODULE}")
            launcher.append(a)
            if arity[flag] and not eq:
                value = next(it, None)
                if value is None:
                    raise ValueError(f"{a} needs a value")
                launcher.append(value)
        else:
            trainer.append(a)
    return launcher, trainer


def _given(launcher: Sequence[str], *names: str) -> bool:
    return any(a.partition("=")[0] in names for a in launcher)


def _world(args) -> Optional[int]:
    """nnodes x nproc_per_node when both are fixed numbers, else None (elastic ranges, "auto")."""
    nnodes, nproc = str(args.nnodes), str(args.nproc_per_node)
    lo, _, hi = nnodes.partition(":")
    if not (lo.isdigit() and (not hi or hi == lo) and nproc.isdigit()):
        return None
    return int(lo) * int(nproc)


def check_config(trainer_args: Sequence[str], world: Optional[int], local: Optional[int]):
    """The TrainConfig of the command line, checked as each rank will check it (train.validate,
    the tokenizer); one line and SystemExit(2) on bad input. None-world: not checked against
    the rank count."""
    from earl_megatron.config.compose import compose, split_args
    from earl_megatron.train import configure, make_tokenizer, reporting_errors, validate
    from omegaconf import OmegaConf

    try:
        d = OmegaConf.to_container(compose(trainer_args), resolve=True)
        overrides = split_args(trainer_args)[2]
    except Exception as e:  # noqa: BLE001 - Hydra's errors have several types; all are config
        print(f"configuration error: {' '.join(str(e).split())}", file=sys.stderr)
        raise SystemExit(2)
    cfg = reporting_errors(configure, d, overrides)
    from earl_megatron.trackers import check_installed
    reporting_errors(check_installed, cfg.run.loggers)   # before any rank starts
    if world is not None:
        before = os.environ.get("LOCAL_WORLD_SIZE")
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
        try:
            reporting_errors(validate, cfg, world)
        finally:
            if before is None:
                os.environ.pop("LOCAL_WORLD_SIZE", None)
            else:
                os.environ["LOCAL_WORLD_SIZE"] = before
    reporting_errors(make_tokenizer, cfg)
    return cfg


HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"
"""How Hydra's hint after a worker's traceback starts: a hint, never the worker's error."""


def last_error(log_text: str) -> Optional[str]:
    """The line of a rank's stderr log that says why it failed: the exception line of its last
    traceback (``Type: message``, the first unindented line after the frames; the last one of a
    chain of exceptions), else its last non-empty line; Hydra's hint is skipped. None: the log
    says nothing."""
    lines = [ln.rstrip() for ln in log_text.splitlines()
             if ln.strip() and not ln.lstrip().startswith(HYDRA_HINT)]
    tracebacks = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent ")]
    if tracebacks:
        said = next((ln for ln in lines[tracebacks[-1] + 1:] if not ln[0].isspace()), None)
        if said is not None:
            return said.strip()
    return lines[-1].strip() if lines else None


def failure_line(error, log_dir: Path) -> str:
    """One line for torchrun's ChildFailedError: the first failing rank, how it ended, its last
    error (``last_error`` of its stderr log) and the log's path. A bad input found while training (a layout that
    no longer fits) is reported by rank 0 alone and every rank exits 2: when the first to exit
    has nothing in its log, the line is that of a rank that exited 2 and said why."""
    first, failure0 = error.get_first_failure()
    said = []
    ranks = sorted(error.failures.items(), key=lambda rf: rf[0] != first)
    if failure0.exitcode != 2:
        ranks = ranks[:1]
    for rank, failure in ranks:
        if failure.exitcode != failure0.exitcode:
            continue
        log = Path(failure.error_file).parent / "stderr.log" if failure.error_file else None
        if log is None or not log.is_file():
            log = _stderr_log(log_dir, failure.local_rank)
        error_line = last_error(log.read_text(errors="replace")) if log is not None else None
        said.append((error_line is not None, rank, failure, log, error_line))
    _, rank, failure, log, error_line = next((x for x in said if x[0]), said[0])
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with status {code}"
    last = f": {error_line}" if error_line else ""
    where = f"; log {log}" if log is not None else f"; logs under {log_dir}"
    return f"earl train: rank {rank} (pid {failure.pid}) {how}{last}{where}"


def _stderr_log(log_dir: Path, local_rank: int) -> Optional[Path]:
    """The newest ``<log_dir>/<run id>/attempt_<n>/<local_rank>/stderr.log`` (torchrun's)."""
    found = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def train(argv: Sequence[str]) -> int:
    from earl_megatron.quiet import quiet_known_warnings
    quiet_known_warnings()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        launcher, trainer = launcher_and_trainer_args(argv)
    except ValueError as e:
        print(f"earl train: {e}", file=sys.stderr)
        return 2
    parser = get_args_parser()
    args = parser.parse_args([*launcher, "-m", TRAINER_MODULE, *trainer])
    world = _world(args)
    cfg = check_config(trainer, world, int(args.nproc_per_node) if world else None)
    log_dir = Path(args.log_dir or Path(cfg.run.output_dir) / "logs").absolute()
    if not args.log_dir:
        args.log_dir = str(log_dir)
    if not _given(launcher, "-r", "--redirects", "-t", "--tee"):
        args.redirects = "2"   # each worker's stderr to its log; rank 0's stdout stays live
    # torchrun's agent logs every step of a failure; the summary line below says what matters
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # torchrun's own default, without its banner
    try:
        run(args)
    except ChildFailedError as e:
        print(failure_line(e, log_dir), file=sys.stderr, flush=True)
        rank, failure = e.get_first_failure()
        return 2 if failure.exitcode == 2 else 1
    return 0


def _tool(filename: str, argv: Sequence[str]) -> int:
    path = TOOLS / filename
    if not path.is_file():
        print(f"earl: {path} not found (earl plan and earl convert run the repository's tools/; "
              f"install from a clone: pip install -e .)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location(f"earl_tools_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(list(argv)) or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "train":
        return train(rest)
    if command == "plan":
        return _tool("plan_layouts.py", rest)
    if command == "serve":
        return serve(rest)
    if command == "view":
        from earl_megatron.viewer.server import main as view
        return view(rest)
    if command == "convert" and rest and rest[0] in CONVERSIONS:
        return _tool(CONVERSIONS[rest[0]], rest[1:])
    print(USAGE, file=sys.stderr)
    return 0 if command in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
