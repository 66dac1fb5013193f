"""SGLang server processes: the command line (pure) and one supervised process per server.

``SGLangConfig`` says how servers are launched; ``server_command`` turns it into a command line
(tested without a server); ``_Server`` starts one process in its own session (so its scheduler
and detokenizer children share its process group), waits for ``/health``, posts JSON and stops
the whole group by its id. ``sglang_sampling_params`` / ``parse_generation`` translate one /generate request and answer
(pure). Nothing here knows about rollouts or weights.

Invariants:
- Only processes this module started are stopped, by their process group id, never by name.
- A port already in use is refused before launch: someone else's server there would answer
  our /health checks.
- On device="cpu" the kit's flags (CPU_FLAGS) are added; tp > 1 needs two environment variables
  (set here unless the caller sets them): SGLANG_CPU_OMP_THREADS_BIND (one core list per rank,
  ``|``-separated) and SGLANG_NCCL_SO_PATH pointing at no file, so SGLang skips PyNccl (which
  refuses CPU tensors) and all-reduces over gloo. Server i's ranks bind cores from
  base_gpu_id + i * tp_size (as GPUs are picked on cuda), and several servers on too few cores
  run without SGLang's overlap scheduler (``overlap_schedule``).
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from earl_megatron.config.train import SGLANG_MEM_FRACTION
from earl_megatron.rollout.engine import SamplingParams

# Flags that pick SGLang's code paths that run without a GPU (docs/sglang.md, CPU section).
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
    """Tensor-parallel size of each server (from the selector's rollout layout)."""
    device: str = "cuda"
    """"cuda" (the cluster path) or "cpu" (tiny models, tests; adds CPU_FLAGS)."""
    host: str = "127.0.0.1"
    ports: Optional[tuple[int, ...]] = None
    """One port per server; None picks free ports."""
    base_gpu_id: int = 0
    """Server i uses GPUs base_gpu_id + i * tp_size ... + tp_size - 1; on cpu the same numbers
    pick its ranks' cores among this process's usable ones (``server_env``)."""
    dtype: Optional[str] = None
    """None: "float32" on cpu, SGLang's "auto" on cuda."""
    mem_fraction_static: Optional[float] = None
    """None: config.train.SGLANG_MEM_FRACTION["cpu"] (0.05, KV pool as a share of host RAM) on
    cpu, SGLang's own default on cuda. The trainer always passes rollout.sglang_mem_fraction's
    value, which its selector plans the servers' memory with."""
    enable_memory_saver: bool = False
    """Launch with --enable-memory-saver so release_memory/resume_memory work (GPU only)."""
    sleep_on_idle: Optional[bool] = None
    """Let the scheduler sleep when idle (--sleep-on-idle). None: on for cpu, where an idle
    server otherwise busy-polls at ~70% of a core and starves the trainer; off on cuda."""
    overlap_schedule: Optional[bool] = None
    """SGLang's overlap scheduler (a second busy thread per server rank). None: on, except on
    cpu when several servers share the host with fewer than 2 cores per server rank
    (the function ``overlap_schedule``); measured on 2 cores: dp2 8x faster without it, tp1 1.4x and
    tp2 1.5x slower."""
    host_servers: Optional[int] = None
    """Servers of tp_size ranks sharing this host's cores, counting other engines' (the trainer
    runs one engine per rollout replica); None: num_servers."""
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
        if self.ports is not None and len(self.ports) != self.num_servers:
            raise ValueError(f"need one port per server: {len(self.ports)} ports for "
                             f"{self.num_servers} servers")
        if self.host_servers is not None and self.host_servers < self.num_servers:
            raise ValueError(f"host_servers ({self.host_servers}) counts this engine's "
                             f"{self.num_servers} servers too; pass at least that")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


def server_command(config: SGLangConfig, index: int, port: int, model_path: str) -> list[str]:
    """The command line of server ``index`` (pure; the launch happens in _Server.start)."""
    cmd = [config.python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", config.host, "--port", str(port)]
    if config.device == "cpu":
        cmd += list(CPU_FLAGS)
        cmd += ["--dtype", config.dtype or "float32",
                "--mem-fraction-static",
                str(config.mem_fraction_static or SGLANG_MEM_FRACTION["cpu"])]
        if config.tp_size > 1:
            cmd += ["--tp-size", str(config.tp_size)]
    else:
        cmd += ["--tp-size", str(config.tp_size),
                "--base-gpu-id", str(config.base_gpu_id + index * config.tp_size)]
        if config.dtype:
            cmd += ["--dtype", config.dtype]
        if config.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(config.mem_fraction_static)]
        if config.enable_memory_saver:
            cmd += ["--enable-memory-saver"]
    if not overlap_schedule(config):
        cmd += ["--disable-overlap-schedule"]
    if config.sleep_on_idle or (config.sleep_on_idle is None and config.device == "cpu"):
        cmd += ["--sleep-on-idle"]
    if config.skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    return cmd + list(config.extra_args)


LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
"""Variables of the trainer's launcher (torchrun) that a server must not inherit: with
TORCHELASTIC_USE_AGENT_STORE set, SGLang's rendezvous for the weight-update group joins as a
client of an agent store that does not exist at that port, and the group never forms."""


def server_environ(parent: dict[str, str], config: SGLangConfig,
                   index: int = 0) -> dict[str, str]:
    """A server's whole environment: ``parent`` less the launcher's variables, plus
    ``server_env``."""
    env = {k: v for k, v in parent.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(server_env(config, index))
    return env


def overlap_schedule(config: SGLangConfig) -> bool:
    """Whether the servers keep SGLang's overlap scheduler (SGLangConfig.overlap_schedule)."""
    if config.overlap_schedule is not None:
        return config.overlap_schedule
    if config.device != "cpu":
        return True
    servers = config.host_servers or config.num_servers
    return servers == 1 or 2 * servers * config.tp_size <= len(usable_cores())


def usable_cores() -> list[int]:
    """The cores this process may run on, in order (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def server_env(config: SGLangConfig, index: int = 0) -> dict[str, str]:
    """Environment variables of server ``index`` (on top of os.environ and config.env).

    CPU: one OpenMP core list per tp rank, else SGLang refuses more ranks than NUMA nodes. The
    CPU analogue of ``--base-gpu-id``: server i's rank r takes usable core (base_gpu_id + i *
    tp_size + r) mod their count (this process's affinity: a Slurm step's cpuset, not the host),
    so dp servers on one host spread over its cores (all of them on core 0 ran 10-30x slower,
    their OpenMP threads spinning against each other). With tp > 1, PyNccl pointed at no file
    so the all-reduce runs over gloo (the CUDA torch wheel ships libnccl, and PyNccl then
    refuses CPU tensors)."""
    env: dict[str, str] = {}
    if config.device == "cpu":
        cores = usable_cores()
        first = config.base_gpu_id + index * config.tp_size
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[(first + r) % len(cores)])
                                                      for r in range(config.tp_size))
        if config.tp_size > 1:
            env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
    env.update(dict(config.env))
    return env




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
        env = server_environ(os.environ, self.config, self.index)
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
            self.proc = subprocess.Popen(_owned(cmd), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
            log.write(f"=== pid {self.proc.pid} (process group {self.proc.pid})\n".encode())
            log.flush()
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
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:  # some routes answer plain text (/flush_cache: "Cache flushed...")
            return body.decode(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _owned(cmd: list[str]) -> list[str]:
    """``cmd`` under a shell that kills the whole process group when the server exits or when
    this process (its owner) is gone. The server runs in its own session so stop() reaches its
    children, which also means nothing would stop it if the owner died without close()
    (SIGKILL, a launcher's kill after a timeout): seen here, servers outlived a killed trainer."""
    # the server exec's into the shell, so its pid is the one the engine watches and a test
    # kills; the watchdog subshell polls both ($$ stays the server's pid in a subshell)
    script = (f"( while kill -0 {os.getpid()} 2>/dev/null && kill -0 $$ 2>/dev/null; "
              f"do sleep 2; done; kill -KILL 0 ) & exec {shlex.join(cmd)}")
    return ["/bin/sh", "-c", script]


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
