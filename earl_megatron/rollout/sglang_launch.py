"""SGLang servers as data: how they are launched and what one /generate request and answer are.

Pure (no process, no socket, no HTTP): ``SGLangConfig`` says how servers are launched;
``server_command`` turns it into a command line and ``server_environment`` / ``server_variables``
into an environment (tested without a server); ``sglang_sampling_params`` / ``parse_generation``
translate one /generate request and answer. rollout/sglang_server.py runs the processes.

Invariants:
- On device="cpu" the kit's flags (CPU_FLAGS) are added; tp > 1 needs two environment variables
  (set here unless the caller sets them): SGLANG_CPU_OMP_THREADS_BIND (one core list per rank,
  ``|``-separated) and SGLANG_NCCL_SO_PATH pointing at no file, so SGLang skips PyNccl (which
  refuses CPU tensors) and all-reduces over gloo; LoRA adapters on cpu take the torch backend and
  the kit's pinning shim (EARL_SGLANG_CPU_PINNING). Server i's ranks bind cores from
  base_gpu_id + i * tp_size (as GPUs are picked on cuda), and several servers on too few cores
  run without SGLang's overlap scheduler (``overlap_schedule``).
- A server inherits no variable of the trainer's launcher (``LAUNCHER_PREFIXES``).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from typing import Any, Optional

from earl_megatron.config.checks import ConfigError
from earl_megatron.config.train import SGLANG_MEM_FRACTION
from earl_megatron.rollout.engine import SamplingParams

# Flags that pick SGLang's code paths that run without a GPU (docs/sglang.md, CPU section).
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend",
             "pytorch", "--disable-cuda-graph", "--skip-server-warmup")


class SGLangServerError(RuntimeError):
    """A server could not be started, or stayed unreachable after the allowed restarts."""


class SGLangServerUnreachable(SGLangServerError):
    """A server died, stalled or stopped answering outside a supervised request (a weight push,
    forming the weight-update group): pass its index to ``SGLangEngine.recover``."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class SGLangWeightsLost(SGLangServerError):
    """A server restarted, but its weights exist nowhere on disk and nobody can push them."""




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
    ep_size: int = 1
    """Expert-parallel size inside each server (--ep-size, MoE models; must divide tp_size:
    SGLang splits each server's tp ranks into ep x moe-tp). 1: every expert tp-split."""
    device: str = "cuda"
    """"cuda" (the cluster path) or "cpu" (tiny models, tests; adds CPU_FLAGS)."""
    host: str = "127.0.0.1"
    ports: Optional[tuple[int, ...]] = None
    """One port per server; None picks free ports."""
    base_gpu_id: int = 0
    """Server i uses GPUs base_gpu_id + i * tp_size ... + tp_size - 1; on cpu the same numbers
    pick its ranks' cores among this process's usable ones (``server_variables``)."""
    dtype: Optional[str] = None
    """None: "float32" on cpu, SGLang's "auto" on cuda."""
    mem_fraction_static: Optional[float] = None
    """None: config.train.SGLANG_MEM_FRACTION["cpu"] (0.05, KV pool as a share of host RAM) on
    cpu, SGLang's own default on cuda. The trainer always passes rollout.sglang_mem_fraction's
    value, which its selector plans the servers' memory with."""
    max_total_tokens: Optional[int] = None
    """Cap on each server's KV pool in tokens (``--max-total-tokens``; SGLang takes the smaller
    of it and what mem_fraction_static leaves). None: no cap. The trainer passes
    config.train.sglang_kv_tokens (its rollout's worst case on cpu, None on cuda)."""
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
    """Seconds one start may take until the server answers /health and proves its identity
    (the trainer: cluster.server_start_timeout_s)."""
    request_timeout_s: float = 300.0
    """Seconds one request may go unanswered; past it the server counts as stalled and is
    restarted like a dead one, whatever /health says (cluster.server_request_timeout_s)."""
    max_restarts: int = 2
    """Restarts allowed per server per request before the request raises; also the retries of
    a first start (cluster.server_max_restarts)."""
    api_key: Optional[str] = None
    """Key every request must carry; None: SGLangEngine draws a random one per engine."""
    load_format: Optional[str] = None
    """SGLang's --load-format for starts from ``model_path``; "dummy": the directory needs only
    config.json and the weights arrive by update_weights_from_distributed (nothing of the
    model's size on disk). Restarts after update_weights(dir) load that directory for real."""
    log_dir: Optional[str] = None
    """Where server logs go (server-<i>.log); None makes a temporary directory."""
    lora_rank: int = 0
    """> 0: the servers serve LoRA adapters of up to this rank over the base they hold
    (``--enable-lora``; each version is loaded as an adapter, rollout/sglang_weights.py
    ``load_adapter``); 0: no adapters."""
    lora_targets: tuple[str, ...] = ()
    """The HF modules the adapters adapt (``q_proj``, ..., ``down_proj``), with lora_rank."""

    def __post_init__(self):
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.num_servers < 1 or self.tp_size < 1:
            raise ValueError(f"num_servers and tp_size must be >= 1, got "
                             f"{self.num_servers}, {self.tp_size}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size}): "
                             "SGLang takes a server's expert parallelism from its tp ranks")
        if self.ports is not None and len(self.ports) != self.num_servers:
            raise ValueError(f"need one port per server: {len(self.ports)} ports for "
                             f"{self.num_servers} servers")
        if self.host_servers is not None and self.host_servers < self.num_servers:
            raise ValueError(f"host_servers ({self.host_servers}) counts this engine's "
                             f"{self.num_servers} servers too; pass at least that")
        if self.api_key is not None and self.api_key.startswith("-"):
            raise ValueError("api_key must not start with '-': SGLang reads its --config file "
                             "into argv, where such a key is taken for an option")
        if bool(self.lora_rank) != bool(self.lora_targets) or self.lora_rank < 0:
            raise ValueError(f"lora_rank ({self.lora_rank}) and lora_targets "
                             f"({self.lora_targets}) go together: a rank > 0 and the modules")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not (self.startup_timeout_s > 0 and self.request_timeout_s > 0):
            raise ValueError(f"startup_timeout_s and request_timeout_s must be > 0, got "
                             f"{self.startup_timeout_s}, {self.request_timeout_s}")


def server_command(config: SGLangConfig, index: int, port: int, model_path: str, *,
                   served_name: Optional[str] = None, secrets_file: Optional[str] = None,
                   load_format: Optional[str] = None) -> list[str]:
    """The command line of server ``index`` (pure; the launch happens in _Server.start).
    ``served_name``: this start's identity nonce; ``secrets_file``: the --config YAML holding
    the API key; ``load_format``: SGLang's --load-format (None: its default)."""
    cmd = [config.python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", config.host, "--port", str(port)]
    if secrets_file is not None:
        cmd += ["--config", str(secrets_file)]
    if served_name is not None:
        cmd += ["--served-model-name", served_name]
    if load_format is not None:
        cmd += ["--load-format", load_format]
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
    if config.max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(config.max_total_tokens)]
    if config.ep_size > 1:
        cmd += ["--ep-size", str(config.ep_size)]
    if not overlap_schedule(config):
        cmd += ["--disable-overlap-schedule"]
    if config.sleep_on_idle or (config.sleep_on_idle is None and config.device == "cpu"):
        cmd += ["--sleep-on-idle"]
    if config.skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    if config.lora_rank:
        # two slots: a new version's adapter loads before the last one is unloaded
        cmd += ["--enable-lora", "--max-lora-rank", str(config.lora_rank),
                "--lora-target-modules", *config.lora_targets, "--max-loras-per-batch", "2"]
        if config.device == "cpu":
            cmd += ["--lora-backend", "torch_native"]   # the others are GPU kernels
    return cmd + list(config.extra_args)


LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
"""Variables of the trainer's launcher (torchrun) that a server must not inherit: with
TORCHELASTIC_USE_AGENT_STORE set, SGLang's rendezvous for the weight-update group joins as a
client of an agent store that does not exist at that port, and the group never forms."""


def server_environment(parent: dict[str, str], config: SGLangConfig,
                   index: int = 0) -> dict[str, str]:
    """A server's whole environment: ``parent`` less the launcher's variables, plus
    ``server_variables``."""
    env = {k: v for k, v in parent.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env.update(server_variables(config, index))
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


def server_variables(config: SGLangConfig, index: int = 0) -> dict[str, str]:
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
        if config.lora_rank:
            # SGLang's LoRA pins host memory, which torch refuses without a GPU: the CPU kit's
            # shim makes pinning a no-op (tools/sglang_cpu/earl_cpu_pinning.py)
            env["EARL_SGLANG_CPU_PINNING"] = "off"
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


BUILD_HINT = ("build a CPU venv with `make sglang` (tools/sglang_cpu/setup.sh), or `pip install "
              "sglang` in a separate venv on GPU machines, then set EARL_SGLANG_PYTHON=<venv>/"
              "bin/python (recipes/rollout/sglang.yaml reads it) or rollout.sglang_python=...")


def check_sglang_python(python: Optional[str], timeout_s: float = 300.0) -> str:
    """ConfigError unless ``python`` is an executable that imports sglang; its version."""
    if not python:
        raise ConfigError(f"rollout.engine=sglang needs rollout.sglang_python; {BUILD_HINT}")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ConfigError(f"rollout.sglang_python={python} is not an executable file; "
                          f"{BUILD_HINT}")
    try:
        r = subprocess.run([python, "-c", "import sglang; print(sglang.__version__)"],
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"rollout.sglang_python={python}: `import sglang` did not finish in "
                          f"{timeout_s:.0f} s; {BUILD_HINT}") from None
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise ConfigError(f"rollout.sglang_python={python} cannot import sglang:\n{tail}\n"
                          f"{BUILD_HINT}")
    return r.stdout.strip()
