"""SGLang server processes: one supervised process per server.

``_Server`` starts one process (the command line and environment of rollout/sglang_launch.py)
in its own session (so its scheduler and detokenizer children share its process group), waits
for ``/health`` and for the server to prove it is the one just started, posts JSON and stops
the whole group by its id. Nothing here knows about rollouts or weights.

Invariants:
- Only processes this module started are stopped, by their process group id, never by name.
- Only the trainer can drive a server: each is launched with an API key (``SGLangConfig.api_key``,
  random per engine) that every request sends as ``Authorization: Bearer``; the key travels in a
  0600 ``--config`` file, never on a command line (which any local user can read in /proc).
- A server is trusted only once it proved its identity: each start gets a fresh random
  ``--served-model-name``, and /health counts only when /model_info (which needs the key)
  answers with that name; a foreign process on the port is a failed start, never our server.
- Every start picks a new port (a configured port is used for the first start only), so a
  retry never waits on a port held by the process it replaces or by someone else; a configured
  port already in use is refused before launch.
- HTTP never goes through a proxy: the opener has an empty ProxyHandler, so ``http_proxy``
  (set on many clusters) cannot send loopback requests elsewhere.
- A server dies with its owner (``_watched_by_owner``), even one killed without a chance to
  clean up.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

from earl_megatron.rollout.sglang_launch import (SGLangConfig, SGLangRequestError,
                                                 SGLangServerError, server_command,
                                                 server_environment)
from earl_megatron.runtime.fault_points import fault_point

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Every request to a server: no proxy, whatever http_proxy / HTTP_PROXY say."""


class _Unreachable(Exception):
    """Connection-level failure: the server is dead, hung, stalled or restarting."""


RESTORE_FAULTS = (SGLangServerError, _Unreachable, RuntimeError, OSError, TimeoutError)
"""What a failed start or weight restore raises when the server died (again) meanwhile: a start
error, an HTTP failure, gloo's errors on a dead peer (RuntimeError subclasses), a store timeout.
Each uses one restart attempt."""


class _Server:
    """One SGLang server process: start, wait for /health and its identity, HTTP calls, stop
    (by its pgid). ``port`` is the first start's; every later start picks a new one."""

    def __init__(self, config: SGLangConfig, index: int, port: int, log_dir: Path):
        self.config, self.index, self.port = config, index, port
        self.url = f"http://{config.host}:{port}"
        self.log_path = log_dir / f"server-{index}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()
        self.restarts = 0
        self.starts = 0
        self.served_name: Optional[str] = None  # this start's identity nonce

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, model_path: str, load_format: Optional[str] = None) -> float:
        """Launch the server and block until /health answers 200 and /model_info names this
        start's nonce; returns seconds taken."""
        if self.starts:  # never retry a port: the old process or a stranger may hold it
            self.port = free_ports(self.config.host, 1)[0]
            self.url = f"http://{self.config.host}:{self.port}"
        elif not port_is_free(self.config.host, self.port):
            raise SGLangServerError(f"port {self.port} on {self.config.host} is already in use "
                                    f"(a server left running?); stop it or pass other ports")
        self.starts += 1
        self.served_name = f"earl-{secrets.token_hex(8)}"
        secrets_file = None
        if self.config.api_key:
            secrets_file = str(self.log_path.with_name(f"server-{self.index}.secret.yaml"))
            _write_private(Path(secrets_file), f"api-key: {json.dumps(self.config.api_key)}\n")
        env = server_environment(os.environ, self.config, self.index)
        cmd = server_command(self.config, self.index, self.port, model_path,
                             served_name=self.served_name, secrets_file=secrets_file,
                             load_format=load_format)
        t0 = time.monotonic()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with open(fd, "ab") as log:  # 0600: SGLang may print its arguments, the key with them
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(cmd)}\n".encode())
            log.flush()
            # Own session: the server's children share its process group, stopped as one.
            self.proc = subprocess.Popen(_watched_by_owner(cmd), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
            log.write(f"=== pid {self.proc.pid} (process group {self.proc.pid})\n".encode())
            log.flush()
        fault_point("sglang.start", pid=self.proc.pid, port=self.port, index=self.index,
                    log_dir=str(self.log_path.parent))
        deadline = t0 + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise SGLangServerError(
                    f"SGLang server {self.index} (port {self.port}) exited with code "
                    f"{self.proc.returncode} while starting. Log {self.log_path}:\n"
                    f"{self.log_tail()}")
            if self.healthy(timeout=2.0):
                if not self.is_ours():
                    self.stop()
                    raise SGLangServerError(
                        f"port {self.port} answers /health but not as the server just started "
                        f"(no /model_info with served_model_name {self.served_name}): another "
                        f"process holds the port; the next start takes another port")
                return time.monotonic() - t0
            time.sleep(0.5)
        self.stop()
        raise SGLangServerError(
            f"SGLang server {self.index} (port {self.port}) did not answer /health within "
            f"{self.config.startup_timeout_s:.0f} s (raise startup_timeout_s for big models). "
            f"Log {self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGKILL the server's process group, then reap the leader. Never SIGTERM first: to
        SGLang 0.5.23 a TERM to the group is its crash path (the scheduler dies of it, the
        leader's SIGQUIT handler sleeps 5 s "to let GPU activity settle"; measured 5.6 s a
        stop on CPU), and a TERM to the leader alone drains requests for 12.5 s. A stopped
        server is one being discarded (run end, layout change, restart): nothing of it is kept."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session made the server its group leader
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            pass  # unkillable (uninterruptible I/O); its group is gone once the kernel lets go
        self.proc = None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with _OPENER.open(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError):
            return False

    def is_ours(self, timeout: float = 10.0) -> bool:
        """Whether the port's server is this start's: /model_info (key required) names the
        nonce this start was launched with."""
        req = urllib.request.Request(self.url + "/model_info", headers=self._headers())
        try:
            with _OPENER.open(req, timeout=timeout) as r:
                info = json.loads(r.read())
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError,
                ValueError):
            return False
        return isinstance(info, dict) and info.get("served_model_name") == self.served_name

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def post(self, route: str, payload: dict[str, Any], timeout: float) -> Any:
        """POST JSON; _Unreachable on connection failures and on no answer within ``timeout``
        (a stall), SGLangRequestError on a live refusal."""
        req = urllib.request.Request(self.url + route, data=json.dumps(payload).encode(),
                                     headers=self._headers())
        try:
            with _OPENER.open(req, timeout=timeout) as r:
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


def _watched_by_owner(cmd: list[str]) -> list[str]:
    """``cmd`` under a shell that kills the whole process group when the server exits or when
    this process (its owner) is gone. The server runs in its own session so stop() reaches its
    children, which also means nothing would stop it if the owner died without close()
    (SIGKILL, a launcher's kill after a timeout): seen here, servers outlived a killed trainer."""
    # the server exec's into the shell, so its pid is the one the engine watches and a test
    # kills; the watchdog subshell polls both ($$ stays the server's pid in a subshell)
    script = (f"( while kill -0 {os.getpid()} 2>/dev/null && kill -0 $$ 2>/dev/null; "
              f"do sleep 2; done; kill -KILL 0 ) & exec {shlex.join(cmd)}")
    return ["/bin/sh", "-c", script]


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only this user can read (0600 from creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file of that name keeps its mode otherwise
    with open(fd, "w") as f:
        f.write(text)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener not
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_ports(host: str, n: int) -> tuple[int, ...]:
    """n distinct free ports (all held open at once while choosing, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


def process_group_gone(pgid: int, within_s: float = 30.0) -> bool:
    """True once no process of group ``pgid`` exists, waiting up to ``within_s``. SIGKILLed
    children stay zombies, still in their group, until init reaps them (that can take longer than
    a check right after a stop): a group still there after the wait outlived its stop."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
