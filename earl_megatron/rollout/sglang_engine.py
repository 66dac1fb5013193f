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
  dies, a request fails with a connection error, or a request gets no answer within
  ``request_timeout_s`` (a stall, whatever /health says), that server is restarted (on a new
  port), given its weights back (the last ``update_weights`` directory, or ``on_restart`` for
  pushed weights) and its whole chunk is resubmitted; every failed start or weight restore uses
  one of ``max_restarts`` attempts, after which the call raises ``SGLangServerError``.
- A failure outside a supervised request (a weight push, forming the weight-update group)
  surfaces as ``SGLangServerUnreachable``; the caller hands it to ``recover(index)``, which runs
  the same restart-and-restore path, so a death there is handled like one during a rollout.
- Each engine draws a random API key (``secrets.token_hex``: never a leading '-', which SGLang's
  argument parser would take for an option) unless the config names one;
  requests without it are refused by the servers (sglang_server.py, sglang_launch.py).
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

Weights: ``update_weights(hf_dir)`` uses ``/update_weights_from_disk`` (any device). Pushed
tensors (``push_weights_distributed``, sglang_weights.py) exist nowhere on disk: a restarted server
needs ``on_restart`` to re-push them, or the restart raises rather than sample from the wrong
policy. A push may carry a weight version; every later answer must carry it too. With
``load_format="dummy"`` the servers start from config.json alone (random weights SGLang makes
up) and must receive a push before the first request; a restart then starts from the config
again and ``on_restart`` pushes.

Memory: release_memory/resume_memory need --enable-memory-saver and CUDA; on device="cpu" they
raise (SGLang 0.5.23's scheduler calls torch.cuda.synchronize there and the whole server dies).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from earl_megatron.rollout.engine import (EngineHealth, Generation, SamplingParams,
                                          check_prompts, split_evenly)
from earl_megatron.rollout.sglang_launch import (CPU_FLAGS, SGLangConfig,
                                                 SGLangRequestError, SGLangServerError,
                                                 SGLangServerUnreachable, SGLangWeightsLost,
                                                 parse_generation,
                                                 server_command, server_environment,
                                                 server_variables, sglang_sampling_params)
from earl_megatron.rollout.sglang_server import (RESTORE_FAULTS, _Server, _Unreachable,
                                                 free_ports, port_is_free)
from earl_megatron.rollout.sglang_weights import WeightUpdateGroup, trainer_weight_update_group
from earl_megatron.runtime.fault_points import fault_point

__all__ = ["CPU_FLAGS", "RESTORE_FAULTS", "SGLangConfig", "SGLangEngine", "SGLangRequestError",
           "SGLangServerError", "SGLangServerUnreachable", "SGLangWeightsLost",
           "parse_generation", "server_command", "server_variables", "server_environment",
           "sglang_sampling_params", "trainer_weight_update_group", "free_ports", "port_is_free"]


class SGLangEngine(WeightUpdateGroup):
    """``RolloutEngine`` over ``config.num_servers`` supervised SGLang servers.

    Starts the servers in the constructor (concurrently) and stops them in ``close()``; use it
    as a context manager. ``on_restart(index)`` runs after server ``index`` was restarted, e.g.
    to re-push weights sent with update_weights_from_distributed.
    """

    def __init__(self, config: SGLangConfig, on_restart: Optional[Callable[[int], None]] = None):
        if not (os.path.isfile(config.python) and os.access(config.python, os.X_OK)):
            raise FileNotFoundError(
                f"SGLang venv python {config.python!r} not found. Build the venv with "
                f"`make sglang` (CPU: tools/sglang_cpu/setup.sh) or "
                f"`pip install sglang` in a separate venv (GPU), then pass its bin/python.")
        if not (Path(config.model_path) / "config.json").is_file():
            raise FileNotFoundError(f"{config.model_path!r} is not an HF model directory "
                                    f"(no config.json)")
        if config.api_key is None:  # only this process can drive its servers
            config = dataclasses.replace(config, api_key=secrets.token_hex(32))
        self.config = config
        self.on_restart = on_restart
        self._log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="earl-sglang-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._model_path = str(Path(config.model_path).resolve())
        self._load_format = config.load_format
        # False after a distributed push or a dummy start: restarts need on_restart
        self._weights_on_disk = config.load_format != "dummy"
        ports = config.ports or free_ports(config.host, config.num_servers)
        self._servers = [_Server(config, i, p, self._log_dir) for i, p in enumerate(ports)]
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * config.num_servers),
                                        thread_name_prefix="sglang")
        self._closed = False
        self._seed_warned = False
        self.expected_version: Optional[str] = None
        """The weight version of the last distributed push; answers tagged otherwise raise."""
        atexit.register(self.close)
        try:
            self.startup_s = list(self._pool.map(self._first_start, self._servers))
        except BaseException:
            self.close()
            raise

    def _first_start(self, server: _Server) -> float:
        """Start with up to max_restarts retries: on a shared host a start can fail on a memory
        reading taken while other jobs allocate ("Loaded weights leave no GPU memory for the KV
        cache", seen here); the next attempt usually succeeds."""
        for attempt in range(self.config.max_restarts + 1):
            try:
                return server.start(self._model_path, self._load_format)
            except SGLangServerError:
                if attempt == self.config.max_restarts:
                    raise
                server.stop()
        raise AssertionError("unreachable")

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

    def update_weights(self, source: Any, weight_version: Optional[str] = None) -> None:
        """Load an HF checkpoint directory (same architecture) into every server; answers must
        carry ``weight_version`` afterwards (None: the version is no longer checked)."""
        path = Path(os.fspath(source)).resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"update_weights takes an HF model directory; {str(path)!r} has no "
                             f"config.json (for live tensors on GPUs use "
                             f"start_update_weights_from_distributed)")
        self._check_open()
        self._model_path = str(path)  # restarts from here on load these weights
        self._load_format = None
        self._weights_on_disk = True
        # "auto": a server started with --load-format dummy would otherwise keep its
        # dummy loader and refuse the checkpoint ("Failed to get model loader")
        payload = {"model_path": str(path), "flush_cache": True, "load_format": "auto"}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        self.expected_version = weight_version
        for result in self._pool.map(lambda s: self._call(s, "/update_weights_from_disk", payload),
                                     self._servers):
            if not result.get("success", False):
                raise SGLangRequestError(f"update_weights_from_disk failed: {result}")

    def weights_by_name(self, name: str, rows: int) -> list:
        """The first ``rows`` rows of HF tensor ``name`` as server 0 holds it (float32 values,
        SGLang's /get_weights_by_name: slow, for audits and tests), to compare with what was
        pushed."""
        self._check_open()
        got = self._post_all("/get_weights_by_name",
                             [(self._servers[0], {"name": name, "truncate_size": rows})])[0]
        if got is None or (isinstance(got, dict) and "parameter" not in got and
                           got.get("object") == "error"):
            raise SGLangRequestError(f"/get_weights_by_name {name!r} failed: {got}")
        return got["parameter"] if isinstance(got, dict) and "parameter" in got else got

    def flush_cache(self) -> None:
        """Empty every server's radix cache (benchmarks: a repeated prompt is otherwise served
        from the cache)."""
        self._check_open()
        self._post_all("/flush_cache", [(s, {}) for s in self._servers])

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

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")

    def _post_all(self, route: str, calls: list[tuple[_Server, dict]]) -> list[Any]:
        """One unsupervised POST per server; SGLangServerUnreachable names a server that failed
        (the caller decides: ``recover`` it, or give up)."""
        def post(call: tuple[_Server, dict]) -> Any:
            server, payload = call
            try:
                return server.post(route, payload, self.config.request_timeout_s)
            except _Unreachable as e:
                raise SGLangServerUnreachable(
                    f"SGLang server {server.index} (port {server.port}) failed {route}: {e}",
                    server.index) from None

        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            results = list(pool.map(post, calls))
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

    def recover(self, index: int, reason: str) -> None:
        """Restart server ``index`` after a failure outside a supervised request (a weight push,
        group setup: SGLangServerUnreachable, a gloo error) and give it its weights back, as
        ``_call`` does for a request; SGLangServerError after max_restarts failed attempts."""
        self._check_open()
        server = self._servers[index]
        self._recover(server, reason, server.pid, [0], "recover")

    def _call(self, server: _Server, route: str, payload: dict[str, Any]) -> Any:
        """POST with supervision: a server that is unreachable or stalls (no answer within
        request_timeout_s) is restarted, restored and asked again (``_recover``)."""
        attempts = [0]  # shared by every failure of this request
        while True:
            pid = server.pid
            try:
                return server.post(route, payload, self.config.request_timeout_s)
            except _Unreachable as e:
                self._recover(server, str(e), pid, attempts, route)

    def _recover(self, server: _Server, reason: str, pid: Optional[int], attempts: list[int],
                 route: str) -> None:
        """Restart ``server`` (unless another thread did since process ``pid`` failed) and
        restore its weights. A start or restore that fails uses up an attempt too, so the
        wait is bounded by max_restarts x (start + restore)."""
        while True:
            attempts[0] += 1
            if attempts[0] > self.config.max_restarts:
                raise SGLangServerError(
                    f"SGLang server {server.index} (port {server.port}) unreachable for "
                    f"{route} after {self.config.max_restarts} restarts; last error: "
                    f"{reason}. Log {server.log_path}:\n{server.log_tail()}")
            try:
                if self._restart(server, reason, pid):
                    self._after_restart(server)
                return
            except SGLangWeightsLost:
                raise
            except RESTORE_FAULTS as e:
                first = (str(e).splitlines() or [""])[0]
                reason, pid = f"restart failed: {type(e).__name__}: {first}", server.pid

    def _restart(self, server: _Server, reason: str, pid: Optional[int]) -> bool:
        """Stop and start ``server`` (new port, latest weights on disk or the config); False if
        another thread already restarted it since process ``pid`` failed."""
        with server.lock:
            if server.pid != pid and server.alive():
                return False
            server.stop()
            with open(server.log_path, "ab") as log:
                log.write(f"\n=== restart after: {reason}\n".encode())
            server.restarts += 1
            server.start(self._model_path, self._load_format)
            return True

    def _after_restart(self, server: _Server) -> None:
        if self.on_restart is not None:
            self.on_restart(server.index)
        elif not self._weights_on_disk:
            raise SGLangWeightsLost(
                f"SGLang server {server.index} restarted, but its weights came from "
                f"update_weights_from_distributed (or a dummy start) and exist nowhere on disk; "
                f"pass on_restart to re-push them (refusing to sample from other weights)")

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
            if self.adapter is not None:   # LoRA: the version's adapter (load_adapter)
                payload["lora_path"] = self.adapter
            fault_point("sglang.generate", pid=server.pid, index=server.index,
                        version=self.expected_version, log_dir=str(self._log_dir))
            results = self._call(server, "/generate", payload)
            if not isinstance(results, list) or len(results) != len(pending):
                raise SGLangRequestError(f"/generate returned {type(results).__name__} for "
                                         f"{len(pending)} prompts")
            still = []
            for i, item in zip(pending, results):
                ids, lps, reason = parse_generation(item)
                got = (item.get("meta_info") or {}).get("weight_version")
                if self.expected_version is not None and got != self.expected_version:
                    raise SGLangRequestError(
                        f"SGLang server {server.index} answered with weight version {got!r}, "
                        f"expected {self.expected_version!r}: refusing stale samples")
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


