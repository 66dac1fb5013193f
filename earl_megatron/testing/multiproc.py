"""Run a function on N gloo ranks in fresh processes, with hard timeouts (tests and benchmarks).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises the
default process group (gloo, a short collective timeout) in each, calls ``fn(*args)`` and returns
the per-rank results in rank order.

Workers come from a forkserver that imported torch, Megatron-Core and the trainer once
(``PRELOAD``): a spawned worker spends 7-10 CPU-seconds importing them on the 2-core CI host, the
trainer's own modules (transformers among them) 1.4 of those, and the test suite starts several
hundred workers. Each worker gets the caller's environment as it is at the call (as a spawned
one would) and nothing else of the caller's state; their stdout and stderr go to files that
are copied onto the caller's own, rank by rank, when the job ends. Invariants:

- A worker that raises makes the whole call raise, with that worker's traceback in the message.
- A job that runs past ``timeout`` is killed (every process) and raises ``TimeoutError``: a
  mismatched collective costs seconds, never the CI budget.
- ``fn`` must be importable by module path (defined at module level): workers unpickle it.
- Results are pickled to bytes in the worker (tensor data is copied): return picklable values.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from earl_megatron.rollout.sglang_server import process_group_gone  # noqa: F401 (the tests use it from here)
from earl_megatron.runtime.dist import free_port


PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
           "earl_megatron.train"]
"""Imported once by the forkserver, before any worker forks from it (no threads started; none
of these modules reads the environment at import but ``config.compose``'s ``EARL_RECIPES``,
which no worker composes with)."""

_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _worker(rank: int, world_size: int, port: int, collective_timeout_s: float,
            fn: Callable, args: tuple, results, env: dict, logs: tuple[str, str]) -> None:
    # the forkserver's stdout/stderr are whatever they were when it started: write to files the
    # caller copies to its own (pytest's capfd sees them, as with spawned workers)
    for fd, path in zip((1, 2), logs):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at the call, as a spawned worker's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # the trainer's own initialisation: the world's device-mapped backend (runtime/dist.py)
        from earl_megatron.runtime.dist import init_distributed
        init_distributed(collective_timeout_s)
        out = fn(*args)
        # plain pickle copies tensor data; torch's queue would pass a shared-memory handle that
        # dies with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        sys.stderr.flush()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0,
                    collective_timeout_s: float = 60.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; return results in rank order."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    logdir = tempfile.mkdtemp(prefix="earl-workers-")
    logs = [(os.path.join(logdir, f"{r}.out"), os.path.join(logdir, f"{r}.err"))
            for r in range(world_size)]
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(r, world_size, port, collective_timeout_s, fn, args, results, env,
                               logs[r]))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, Any] = {}
    failures: list[str] = []
    try:
        while len(got) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed job {getattr(fn, '__name__', fn)} on {world_size} ranks ran past "
                    f"{timeout:.0f}s; ranks that finished: {sorted(got)}")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in got]
                if dead and not failures:
                    # a rank died without reporting (segfault, OOM kill): give peers a moment
                    time.sleep(2.0)
                    if results.empty():
                        raise RuntimeError(f"ranks {dead} died with exit codes "
                                           f"{[procs[i].exitcode for i in dead]}")
                continue
            if ok:
                got[rank] = pickle.loads(payload)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                break
        if failures:
            raise RuntimeError("distributed job failed:\n" + "\n".join(failures))
        return [got[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        _copy_out(logs)
        shutil.rmtree(logdir, ignore_errors=True)


def _copy_out(logs) -> None:
    """The workers' stdout and stderr, rank by rank, onto this process's own fds 1 and 2."""
    sys.stdout.flush()
    sys.stderr.flush()
    for files in logs:
        for fd, path in zip((1, 2), files):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            while data:
                data = data[os.write(fd, data):]


def kill_torchrun(proc) -> list:
    """SIGKILL a torchrun launched with ``start_new_session=True`` and every worker it started,
    and wait for them all; returns the workers (psutil processes). torchrun starts each worker
    in a session of its own: they are killed by pid with it, or the orphans would hold (and
    later write to the run) beside a relaunch."""
    import contextlib
    import signal

    import psutil

    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for w in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            w.kill()
    proc.wait()
    psutil.wait_procs(workers, timeout=60)
    return workers
