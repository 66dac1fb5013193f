"""SGLang rollout engine: supervised SGLang HTTP servers behind the ``RolloutEngine`` interface.

SGLang pins its own torch and ~11 GB of packages, so it runs from a separate venv (``python``
below) and this module only talks to it over HTTP with the standard library. One server serves
one rollout DP group; each server spans ``tp_size`` GPUs and listens on its own port:

    rollout DP group:   dp0                     dp1                      dp2 ...
    SGLang server:      :port0, GPUs 0..tp-1    :port1, GPUs tp..2tp-1   ...
    generate(prompts):  prompts split into contiguous chunks, one batched POST /generate per
                        server, sent concurrently; results returned in prompt order.

Invariants (on top of engine.py's contract):
- Every prompt of a ``generate`` call is answered exactly once, or the call raises. If a server
  dies or a request fails with a connection error, that server is restarted with the weights it
  last had (the last ``update_weights`` directory) and its whole chunk is resubmitted; after
  ``max_restarts`` failed attempts for one chunk the call raises ``SGLangServerError``.
- Only processes this engine started are stopped, by their process group id (each server is
  started in its own session, so its scheduler and detokenizer children go with it).
- Logprobs are SGLang's ``output_token_logprobs``: log_softmax(logits / T) before top-p, and
  log_softmax(logits) for greedy (T=0), matching engine.py.
- Stop tokens: SGLang stops on ``stop_token_ids`` *and* the model's EOS ids unless
  ``ignore_eos`` is set (which disables both). With no stop tokens we send ``ignore_eos``; with
  some, a stop on an EOS id the caller did not ask for is continued transparently, so the output
  stops only where engine.py says it does.
- Seeds: ``SamplingParams.seed`` is sent as ``sampling_seed`` (seed + prompt index, so equal
  prompts get different samples); SGLang honours it only when the server runs with
  ``--enable-deterministic-inference`` (pass it in ``extra_args``), which SGLang 0.5.23 refuses
  with the CPU attention backend (torch_native); without it a seed warns once and is ignored.

Weights: ``update_weights(hf_dir)`` uses ``/update_weights_from_disk`` (any device, ~0.03 s for
the tiny model). On GPU clusters the trainer pushes tensors instead, no disk involved:

    group = trainer_weight_update_group(addr, port, engine.weight_update_world_size)  # rank 0
        (while engine.start_init_weights_update_group(addr, port) is pending; then .result())
    engine.push_weights_distributed(hf_named_full_tensors, group)
        = /begin_weight_update, /update_weights_from_distributed + one broadcast per tensor from
          rank 0, /end_weight_update (SGLang 0.5.23 refuses pushes outside begin/end)

NCCL on GPUs; the same protocol with backend="gloo" works on CPU (tested). A server restarted
after such a push would come back with stale weights: ``on_restart`` must re-push, or the
restart raises rather than sample from the wrong policy.

Memory: release_memory/resume_memory call /release_memory_occupation and
/resume_memory_occupation, which need --enable-memory-saver and CUDA; on device="cpu" they raise
(SGLang 0.5.23's scheduler calls torch.cuda.synchronize there and the whole server dies).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from earl_megatron.rollout.engine import (EngineHealth, Generation, SamplingParams,
                                          check_prompts, split_evenly)

# Flags that pick SGLang's code paths that run without a GPU (../shared/sglang-cpu/serve.sh).
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend",
             "pytorch", "--disable-cuda-graph", "--skip-server-warmup")


class SGLangServerError(RuntimeError):
    """A server could not be started, or stayed unreachable after the allowed restarts."""


class SGLangRequestError(RuntimeError):
    """A live server rejected a request (bad parameters, failed weight update...)."""


@dataclass(frozen=True)
class SGLangConfig:
    python: str
    """Python executable of the SGLang venv, e.g. ~/.cache/earl-sglang-cpu/bin/python."""
    model_path: str
    """HF model directory served at start (config.json + safetensors)."""
    num_servers: int = 1
    """One server per rollout DP group."""
    tp_size: int = 1
    """Tensor-parallel size of each server (from the selector's rollout layout); GPU only."""
    device: str = "cuda"
    """"cuda" (the cluster path) or "cpu" (tiny models, tests; adds CPU_FLAGS)."""
    host: str = "127.0.0.1"
    ports: Optional[tuple[int, ...]] = None
    """One port per server; None picks free ports."""
    base_gpu_id: int = 0
    """Server i uses GPUs base_gpu_id + i * tp_size ... + tp_size - 1."""
    dtype: Optional[str] = None
    """None: "float32" on cpu, SGLang's "auto" on cuda."""
    mem_fraction_static: Optional[float] = None
    """None: 0.05 on cpu (KV pool as a share of host RAM), SGLang's default on cuda."""
    enable_memory_saver: bool = False
    """Launch with --enable-memory-saver so release_memory/resume_memory work (GPU only)."""
    sleep_on_idle: Optional[bool] = None
    """Let the scheduler sleep when idle (--sleep-on-idle). None: on for cpu, where an idle
    server otherwise busy-polls at ~70% of a core and starves the trainer; off on cuda."""
    skip_tokenizer_init: bool = True
    """The engine speaks token ids only, so the model dir needs no tokenizer."""
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables for the server processes."""
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_restarts: int = 2
    """Restarts allowed per server per request before the request raises."""
    log_dir: Optional[str] = None
    """Where server logs go (server-<i>.log); None makes a temporary directory."""

    def __post_init__(self):
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.num_servers < 1 or self.tp_size < 1:
            raise ValueError(f"num_servers and tp_size must be >= 1, got "
                             f"{self.num_servers}, {self.tp_size}")
        if self.device == "cpu" and self.tp_size != 1:
            raise ValueError("SGLang on cpu runs tp_size=1 only (the kit in ../shared/sglang-cpu)")
        if self.ports is not None and len(self.ports) != self.num_servers:
            raise ValueError(f"need one port per server: {len(self.ports)} ports for "
                             f"{self.num_servers} servers")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


def server_command(config: SGLangConfig, index: int, port: int, model_path: str) -> list[str]:
    """The command line of server ``index`` (pure; the launch happens in _Server.start)."""
    cmd = [config.python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", config.host, "--port", str(port)]
    if config.device == "cpu":
        cmd += list(CPU_FLAGS)
        cmd += ["--dtype", config.dtype or "float32",
                "--mem-fraction-static", str(config.mem_fraction_static or 0.05)]
    else:
        cmd += ["--tp-size", str(config.tp_size),
                "--base-gpu-id", str(config.base_gpu_id + index * config.tp_size)]
        if config.dtype:
            cmd += ["--dtype", config.dtype]
        if config.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(config.mem_fraction_static)]
        if config.enable_memory_saver:
            cmd += ["--enable-memory-saver"]
    if config.sleep_on_idle or (config.sleep_on_idle is None and config.device == "cpu"):
        cmd += ["--sleep-on-idle"]
    if config.skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    return cmd + list(config.extra_args)




def sglang_sampling_params(params: SamplingParams, index: int) -> dict[str, Any]:
    """SGLang's per-request sampling_params for prompt ``index`` of a call."""
    sp: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                          "max_new_tokens": params.max_new_tokens}
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    else:
        sp["ignore_eos"] = True  # no stop tokens: only max_new_tokens ends generation
    if params.seed is not None:
        sp["sampling_seed"] = params.seed + index
    return sp


def parse_generation(item: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """Token ids, logprobs and SGLang's finish type ("stop"/"length") of one /generate result."""
    meta = item.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SGLangRequestError(f"SGLang returned no output_token_logprobs (was return_logprob "
                                 f"sent?): {json.dumps(item)[:500]}")
    ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    if "output_ids" in item and list(item["output_ids"]) != ids:
        raise SGLangRequestError(f"output_ids {item['output_ids']} disagree with the ids in "
                                 f"output_token_logprobs {ids}")
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish not in ("stop", "length"):
        raise SGLangRequestError(f"SGLang finished a request with {meta.get('finish_reason')!r}")
    return ids, logprobs, finish


class _Unreachable(Exception):
    """Connection-level failure: the server is dead, hung or restarting."""


class _Server:
    """One SGLang server process: start, wait for /health, HTTP calls, stop (by its pgid)."""

    def __init__(self, config: SGLangConfig, index: int, port: int, log_dir: Path):
        self.config, self.index, self.port = config, index, port
        self.url = f"http://{config.host}:{port}"
        self.log_path = log_dir / f"server-{index}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()
        self.restarts = 0

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, model_path: str) -> float:
        """Launch the server and block until /health answers 200; returns seconds taken."""
        env = dict(os.environ)
        env.update(dict(self.config.env))
        cmd = server_command(self.config, self.index, self.port, model_path)
        if not _port_free(self.config.host, self.port):
            # someone else's server there would answer our /health checks
            raise SGLangServerError(f"port {self.port} on {self.config.host} is already in use "
                                    f"(a server left running?); stop it or pass other ports")
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(cmd)}\n".encode())
            log.flush()
            # Own session: the server's children share its process group, stopped as one.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        deadline = t0 + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise SGLangServerError(
                    f"SGLang server {self.index} (port {self.port}) exited with code "
                    f"{self.proc.returncode} while starting. Log {self.log_path}:\n"
                    f"{self.log_tail()}")
            if self.healthy(timeout=2.0):
                return time.monotonic() - t0
            time.sleep(0.5)
        self.stop()
        raise SGLangServerError(
            f"SGLang server {self.index} (port {self.port}) did not answer /health within "
            f"{self.config.startup_timeout_s:.0f} s (raise startup_timeout_s for big models). "
            f"Log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session made the server its group leader
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                # children may outlive the leader for a moment; the group id is still theirs
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
        self.proc = None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError):
            return False

    def post(self, route: str, payload: dict[str, Any], timeout: float) -> Any:
        """POST JSON; _Unreachable on connection failures, SGLangRequestError on a live refusal."""
        req = urllib.request.Request(self.url + route, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")[:2000]
            if e.code >= 500 and not self.healthy():
                raise _Unreachable(f"HTTP {e.code} from {route} and /health fails: {text}")
            raise SGLangRequestError(f"SGLang server {self.index} refused {route} "
                                     f"(HTTP {e.code}): {text}") from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException,
                TimeoutError, OSError) as e:
            raise _Unreachable(f"{type(e).__name__}: {e}") from None
        return json.loads(body) if body else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener not
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _free_ports(host: str, n: int) -> tuple[int, ...]:
    """n distinct free ports (all held open at once while choosing, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


class SGLangEngine:
    """``RolloutEngine`` over ``config.num_servers`` supervised SGLang servers.

    Starts the servers in the constructor (concurrently) and stops them in ``close()``; use it
    as a context manager. ``on_restart(index)`` runs after server ``index`` was restarted, e.g.
    to re-push weights sent with update_weights_from_distributed.
    """

    def __init__(self, config: SGLangConfig, on_restart: Optional[Callable[[int], None]] = None):
        if not (os.path.isfile(config.python) and os.access(config.python, os.X_OK)):
            raise FileNotFoundError(
                f"SGLang venv python {config.python!r} not found. Build the venv with "
                f"../shared/sglang-cpu/setup.sh ~/.cache/earl-sglang-cpu (CPU) or "
                f"`pip install sglang` in a separate venv (GPU), then pass its bin/python.")
        if not (Path(config.model_path) / "config.json").is_file():
            raise FileNotFoundError(f"{config.model_path!r} is not an HF model directory "
                                    f"(no config.json)")
        self.config = config
        self.on_restart = on_restart
        self._log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="earl-sglang-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._model_path = str(Path(config.model_path).resolve())
        self._weights_on_disk = True  # False after a distributed push: restarts need on_restart
        ports = config.ports or _free_ports(config.host, config.num_servers)
        self._servers = [_Server(config, i, p, self._log_dir) for i, p in enumerate(ports)]
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * config.num_servers),
                                        thread_name_prefix="sglang")
        self._closed = False
        self._seed_warned = False
        atexit.register(self.close)
        try:
            self.startup_s = list(self._pool.map(lambda s: s.start(self._model_path),
                                                 self._servers))
        except BaseException:
            self.close()
            raise

    # -- RolloutEngine ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]:
        check_prompts(prompts)
        self._check_open()
        if params.seed is not None and not self._seed_warned and \
                "--enable-deterministic-inference" not in self.config.extra_args:
            self._seed_warned = True
            warnings.warn("SamplingParams.seed is sent as sampling_seed, but SGLang ignores it "
                          "unless the servers run with --enable-deterministic-inference (add it "
                          "to SGLangConfig.extra_args; GPU attention backends only)")
        chunks = [r for r in split_evenly(len(prompts), len(self._servers)) if len(r)]
        futures = [self._pool.submit(self._generate_chunk, self._servers[i], prompts, r, params)
                   for i, r in enumerate(chunks)]
        out: list[Generation] = []
        for f in futures:
            out.extend(f.result())
        return out

    def update_weights(self, source: Any) -> None:
        """Load an HF checkpoint directory (same architecture) into every server."""
        path = Path(os.fspath(source)).resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"update_weights takes an HF model directory; {str(path)!r} has no "
                             f"config.json (for live tensors on GPUs use "
                             f"start_update_weights_from_distributed)")
        self._check_open()
        self._model_path = str(path)  # restarts from here on load these weights
        self._weights_on_disk = True
        payload = {"model_path": str(path), "flush_cache": True}
        for result in self._pool.map(lambda s: self._call(s, "/update_weights_from_disk", payload),
                                     self._servers):
            if not result.get("success", False):
                raise SGLangRequestError(f"update_weights_from_disk failed: {result}")

    def release_memory(self) -> None:
        self._memory_occupation("/release_memory_occupation")

    def resume_memory(self) -> None:
        self._memory_occupation("/resume_memory_occupation")

    def health(self) -> EngineHealth:
        states = []
        for s in self._servers:
            states.append({"index": s.index, "port": s.port, "pid": s.pid, "alive": s.alive(),
                           "healthy": s.alive() and s.healthy(), "restarts": s.restarts})
        bad = [st for st in states if not st["healthy"]]
        detail = ("all servers healthy" if not bad else
                  "unhealthy: " + ", ".join(f"server {st['index']} (port {st['port']})"
                                            for st in bad))
        return EngineHealth(healthy=not bad and not self._closed, detail=detail,
                            extra={"servers": states, "weights": self.weights,
                                   "log_dir": str(self._log_dir)})

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for s in self._servers:
            s.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        atexit.unregister(self.close)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- introspection (tests, supervision) ---------------------------------------------------
    @property
    def server_pids(self) -> list[Optional[int]]:
        return [s.pid for s in self._servers]

    @property
    def restarts(self) -> list[int]:
        return [s.restarts for s in self._servers]

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    @property
    def weights(self) -> str:
        """Where the served weights come from: an HF directory, or a distributed push."""
        return self._model_path if self._weights_on_disk else "update_weights_from_distributed"

    @property
    def weight_update_world_size(self) -> int:
        """Ranks in the weight-update group: the trainer's rank 0 plus every server TP rank."""
        return 1 + len(self._servers) * self.config.tp_size

    # -- GPU cluster path: weights pushed from the trainer over NCCL --------------------------
    def start_init_weights_update_group(self, master_address: str, master_port: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> Future:
        """Join every server's TP ranks to a process group with the trainer as rank 0.

        World size is 1 + num_servers * tp_size; server i's ranks start at 1 + i * tp_size.
        The servers block until the trainer joins as rank 0 (``trainer_weight_update_group``
        with the same address, port, world size and group name), so this returns a future: start
        it, join, then wait on it.
        """
        self._check_open()
        world = self.weight_update_world_size
        calls = [(s, {"master_address": master_address, "master_port": master_port,
                      "rank_offset": 1 + s.index * self.config.tp_size, "world_size": world,
                      "group_name": group_name, "backend": backend}) for s in self._servers]
        return self._pool.submit(self._post_all, "/init_weights_update_group", calls)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._post_all("/destroy_weights_update_group",
                       [(s, {"group_name": group_name}) for s in self._servers])

    def start_update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]],
                                              group_name: str = "weight_update_group") -> Future:
        """Open a weight-update session and announce HF-named tensors, broadcast from rank 0.

        Returns a future; the trainer broadcasts each tensor on the group in the announced order,
        then waits on it (the future also closes the session with /end_weight_update).
        Afterwards the servers' weights exist nowhere on disk: a restarted server needs
        ``on_restart`` to push them again.
        """
        self._check_open()
        self._weights_on_disk = False
        # SGLang 0.5.23 refuses weight pushes outside a begin/end_weight_update session.
        self._post_all("/begin_weight_update", [(s, {}) for s in self._servers])
        payload = {"names": list(names), "dtypes": list(dtypes),
                   "shapes": [list(s) for s in shapes], "group_name": group_name,
                   "flush_cache": True}

        def update_then_end() -> list[Any]:
            try:
                return self._post_all("/update_weights_from_distributed",
                                      [(s, payload) for s in self._servers])
            finally:
                self._post_all("/end_weight_update", [(s, {}) for s in self._servers])

        return self._pool.submit(update_then_end)

    def push_weights_distributed(self, named_tensors: Sequence[tuple[str, Any]], group: Any,
                                 group_name: str = "weight_update_group") -> None:
        """Broadcast HF-named tensors from this process (rank 0 of ``group``) into every server.

        ``group`` comes from ``trainer_weight_update_group`` after
        ``start_init_weights_update_group``. Tensors must be full (gathered), contiguous, on the
        group's device (cuda for NCCL, cpu for gloo), in the order given.
        """
        import torch.distributed as dist

        names = [n for n, _ in named_tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named_tensors]
        shapes = [list(t.shape) for _, t in named_tensors]
        done = self.start_update_weights_from_distributed(names, dtypes, shapes, group_name)
        for _, tensor in named_tensors:
            if done.done():  # a server refused the update: nobody will receive; fail now
                done.result()
                raise SGLangRequestError("servers finished the update before all tensors were "
                                         "sent (names/shapes out of sync with the tensors?)")
            dist.broadcast(tensor.contiguous(), group=group, group_src=0)
        done.result()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")

    def _post_all(self, route: str, calls: list[tuple[_Server, dict]]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            results = list(pool.map(lambda c: c[0].post(route, c[1],
                                                         self.config.request_timeout_s), calls))
        for r in results:
            if isinstance(r, dict) and not r.get("success", True):
                raise SGLangRequestError(f"{route} failed: {r}")
        return results

    def _memory_occupation(self, route: str) -> None:
        if self.config.device == "cpu":
            # Measured with SGLang 0.5.23: the scheduler calls torch.cuda.synchronize() and the
            # whole server dies. A CPU server is its own process; there is nothing to hand back.
            raise RuntimeError(f"{route} needs CUDA: on device='cpu' SGLang's scheduler crashes "
                               f"on it. Colocated memory release is a GPU feature; on CPU keep "
                               f"the server running (or close() the engine).")
        if not self.config.enable_memory_saver:
            raise RuntimeError(f"{route} needs the servers launched with --enable-memory-saver: "
                               f"set SGLangConfig(enable_memory_saver=True)")
        for s in self._servers:
            self._call(s, route, {})

    def _call(self, server: _Server, route: str, payload: dict[str, Any]) -> Any:
        """POST with supervision: restart a dead server and retry, at most max_restarts times.

        A restart that itself fails (the new process exits or misses startup_timeout_s) uses
        up one attempt too, so the total wait is bounded by max_restarts starts.
        """
        attempt = 0
        while True:
            try:
                return server.post(route, payload, self.config.request_timeout_s)
            except _Unreachable as e:
                last = str(e)
            while True:
                attempt += 1
                if attempt > self.config.max_restarts:
                    raise SGLangServerError(
                        f"SGLang server {server.index} (port {server.port}) unreachable for "
                        f"{route} after {self.config.max_restarts} restarts; last error: "
                        f"{last}. Log {server.log_path}:\n{server.log_tail()}")
                try:
                    restarted = self._restart(server, reason=last)
                    break
                except SGLangServerError as e:
                    last = f"restart failed: {str(e).splitlines()[0]}"
            if restarted:
                self._after_restart(server)

    def _restart(self, server: _Server, reason: str) -> bool:
        """Restart a dead or hung server with the latest weights; False if it is healthy."""
        with server.lock:
            if server.alive() and server.healthy():
                return False  # another thread restarted it already (or the failure was brief)
            server.stop(grace_s=2.0)
            with open(server.log_path, "ab") as log:
                log.write(f"\n=== restart after: {reason}\n".encode())
            server.restarts += 1
            server.start(self._model_path)
            return True

    def _after_restart(self, server: _Server) -> None:
        if self.on_restart is not None:
            self.on_restart(server.index)
        elif not self._weights_on_disk:
            raise RuntimeError(
                f"SGLang server {server.index} restarted, but its weights came from "
                f"update_weights_from_distributed and exist nowhere on disk; pass on_restart to "
                f"re-push them (refusing to sample from the initial weights)")

    def _generate_chunk(self, server: _Server, prompts: Sequence[Sequence[int]], idx: range,
                        params: SamplingParams) -> list[Generation]:
        """Generate for prompts[idx] on one server; continues stops on unrequested EOS ids."""
        stop = set(params.stop_token_ids)
        tokens: dict[int, list[int]] = {i: [] for i in idx}
        logprobs: dict[int, list[float]] = {i: [] for i in idx}
        finish: dict[int, str] = {}
        pending = list(idx)
        while pending:
            payload = {
                "input_ids": [list(map(int, prompts[i])) + tokens[i] for i in pending],
                "sampling_params": [
                    {**sglang_sampling_params(params, i),
                     "max_new_tokens": params.max_new_tokens - len(tokens[i])} for i in pending],
                "return_logprob": True,
            }
            results = self._call(server, "/generate", payload)
            if not isinstance(results, list) or len(results) != len(pending):
                raise SGLangRequestError(f"/generate returned {type(results).__name__} for "
                                         f"{len(pending)} prompts")
            still = []
            for i, item in zip(pending, results):
                ids, lps, reason = parse_generation(item)
                if not ids:
                    raise SGLangRequestError(f"/generate returned no tokens for prompt {i} "
                                             f"(finish {reason!r})")
                tokens[i] += ids
                logprobs[i] += lps
                done_length = len(tokens[i]) >= params.max_new_tokens
                if reason == "stop" and ids and ids[-1] in stop:
                    finish[i] = "stop"
                elif reason == "length" or done_length:
                    finish[i] = "length"
                else:  # stopped on the model's EOS, which the caller did not ask for
                    still.append(i)
            pending = still
        return [Generation(token_ids=tuple(tokens[i]), logprobs=tuple(logprobs[i]),
                           finish_reason=finish[i]) for i in idx]


def trainer_weight_update_group(master_address: str, master_port: int, world_size: int,
                                group_name: str = "weight_update_group", backend: str = "nccl",
                                timeout_s: float = 600.0) -> Any:
    """The trainer's side (rank 0) of the servers' weight-update group, outside the default group.

    The trainer already has its own world (Megatron's); this group joins rank 0 of it with every
    server's TP ranks through a TCP rendezvous at master_address:master_port, the way SGLang's
    /init_weights_update_group joins on its side (a store prefixed with group_name). Call it
    while ``start_init_weights_update_group``'s future is pending.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}",
                                              rank=0, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    # torch has no public API for a group outside the default world; this private helper is
    # what SGLang itself uses, and the store prefix must match its side.
    group, _ = c10d._new_process_group_helper(world, rank, [], dist.Backend(backend),
                                              dist.PrefixStore(group_name, store),
                                              group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group
