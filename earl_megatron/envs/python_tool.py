"""A Python tool for environments: the model's code run in a separate, resource-bounded process.

``PythonSandbox(limits).run(code)`` writes ``code`` to a fresh temporary directory and runs it
with this interpreter in isolated mode (``python -I -S -B``: no user site, no ``PYTHON*``
variables, no ``site`` imports), stdin closed, an empty environment, that directory as the
working directory, and its stdout and stderr in files there. Then it returns a ``PythonResult``:
what the program printed (stdout, then the last line of stderr when it failed), cut to
``limits.output_chars``, and whether it exited 0. The directory is removed afterwards.

Limits (``PythonLimits``), each enforced by the kernel on the child (``setrlimit``):

- ``cpu_seconds``: CPU time, not wall time. A program that loops forever is stopped by SIGXCPU
  after the same amount of work on an idle machine and on a loaded one, so the observation a
  program gets does not depend on the host's load;
- ``memory_mb``: address space (a ``MemoryError`` inside the program, or its death);
- ``output_bytes``: the largest file it may write, its stdout and stderr included (SIGXFSZ
  beyond it);
- ``open_files``: the file descriptors it may hold;
- no new processes (``RLIMIT_NPROC`` 1; the kernel does not apply it to root, whose program's
  children the wall guard's kill of the whole process group still reaches).

``wall_seconds`` is a last-resort guard for a program that sleeps or blocks without using CPU.
It is generous (default 10x ``cpu_seconds``), and the process group is killed when it expires.

Network: by default the program runs in a network namespace of its own (``unshare -rn``, a user
namespace mapped to the caller, so no privilege is needed where the kernel allows user
namespaces), which has no interface but a loopback that is down: no connection leaves it.
Where the host allows no user namespaces, ``check_isolation()`` fails with one line naming the
fix (``network=True``, ``env.kwargs.python.network=true``, runs without the namespace). This
is a resource sandbox and no more: the program runs as this user and can read what this user
can read. Code from a model you do not trust belongs in a container or VM.

Invariants: ``run`` never raises on the program's behaviour (an exception, a crash, a limit are
a ``PythonResult`` with ``ok`` False and the reason after what it printed); nothing of the
caller's environment variables, working directory or standard input reaches the program (its
working directory is a fresh temporary one, whose name it could print).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program and get what it prints (stdout). Nothing persists "
                       "between calls; print the values you need.",
        "parameters": {"type": "object",
                       "properties": {"code": {"type": "string",
                                               "description": "e.g. print(17 * 23)"}},
                       "required": ["code"]}}}
"""The tool as an OpenAI / Hermes tool schema (envs/tool_calls.py lists it in a system prompt)."""


@dataclass(frozen=True)
class PythonLimits:
    cpu_seconds: int = 5
    memory_mb: int = 512
    output_bytes: int = 1 << 20
    open_files: int = 64
    output_chars: int = 2000
    """What the model is shown of the output at most (the rest cut, marked)."""
    wall_seconds: float = 0.0
    """The last-resort wall-clock guard; 0: 10 x cpu_seconds."""
    network: bool = False
    """True: no network namespace (the program may open connections)."""

    def __post_init__(self):
        for key in ("cpu_seconds", "memory_mb", "output_bytes", "open_files", "output_chars"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"python tool limit {key}={value!r} must be an integer >= 1")
        if self.wall_seconds < 0:
            raise ValueError(f"python tool limit wall_seconds={self.wall_seconds} must be >= 0")


@dataclass(frozen=True)
class PythonResult:
    output: str
    """stdout (and, when the program failed, the last line of stderr or the limit it hit)."""
    ok: bool
    """The program exited with status 0 within its limits."""


class PythonSandbox:
    """Runs programs under ``limits`` (module docstring)."""

    def __init__(self, limits: PythonLimits = PythonLimits()):
        self.limits = limits

    def check_isolation(self) -> None:
        """Raise one ValueError naming the fix when the network namespace cannot be made."""
        if not self.limits.network and not _unshare_works():
            raise ValueError("the python tool runs its programs without network in a namespace "
                             "of their own (unshare -rn), which this host refuses (no user "
                             "namespaces, or no util-linux unshare): allow unprivileged user "
                             "namespaces, or set network=true in the tool's limits "
                             "(env.kwargs.python.network=true) to run without one")

    def _command(self, path: str) -> list[str]:
        """The launcher (its limits, then exec of the program), in its namespace."""
        lim = self.limits
        cmd = [sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER, str(lim.cpu_seconds),
               str(lim.memory_mb << 20), str(lim.output_bytes), str(lim.open_files), path]
        return cmd if lim.network else ["unshare", "-rn", *cmd]

    def run(self, code: str) -> PythonResult:
        lim = self.limits
        work = tempfile.mkdtemp(prefix="earl_python_")
        try:
            path = os.path.join(work, "main.py")
            with open(path, "w", encoding="utf-8") as f:
                f.write(code)
            with open(os.path.join(work, "stdout"), "wb") as out, \
                    open(os.path.join(work, "stderr"), "wb") as err:
                proc = subprocess.Popen(self._command(path), cwd=work, env={},
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True)
                try:
                    status = proc.wait(timeout=lim.wall_seconds or 10 * lim.cpu_seconds)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    status, timed_out = proc.wait(), True
            return _result(_read(work, "stdout"), _read(work, "stderr"), status, timed_out, lim)
        finally:
            shutil.rmtree(work, ignore_errors=True)


_LAUNCHER = """
import os, resource, sys
cpu, memory, output, files = (int(a) for a in sys.argv[1:5])
for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory,) * 2),
                    (resource.RLIMIT_FSIZE, (output,) * 2), (resource.RLIMIT_NOFILE, (files,) * 2),
                    (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_NPROC, (1, 1))):
    resource.setrlimit(kind, value)
os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", sys.argv[5]])
"""
"""Sets the kernel's limits (module docstring) in the child, then becomes the program: no
``preexec_fn``, which is unsafe in a process with threads (environments step concurrently)."""


def _read(work: str, name: str) -> str:
    with open(os.path.join(work, name), "rb") as f:
        return f.read().decode("utf-8", errors="replace")


KILLED_BY = {signal.SIGXCPU: "the CPU time limit", signal.SIGKILL: "the memory or CPU limit",
             signal.SIGXFSZ: "the output limit", signal.SIGSEGV: "a crash (segmentation fault)"}


def _result(stdout: str, stderr: str, status: int, timed_out: bool,
            lim: PythonLimits) -> PythonResult:
    if timed_out:
        why = f"stopped: no result within {lim.wall_seconds or 10 * lim.cpu_seconds:g} s"
    elif status < 0:
        why = f"stopped by {KILLED_BY.get(-status, f'signal {-status}')}"
    elif status > 0:
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {status}"
    else:
        why = ""
    if len(stdout) > lim.output_chars:   # the reason it failed is kept whole, after the cut
        stdout = stdout[:lim.output_chars] + f"\n[output cut at {lim.output_chars} characters]"
    text = "\n".join(part for part in (stdout.rstrip("\n"), why[:lim.output_chars]) if part)
    return PythonResult(text, not why)


@functools.lru_cache(maxsize=1)
def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
