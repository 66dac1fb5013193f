#!/usr/bin/env bash
# A separate venv in which a real SGLang server serves tiny models on a CPU-only machine (the
# project's opt-in SGLang tests and CPU demos). SGLang pins its own torch (~11 GB of packages),
# so it never shares the project's venv; the trainer talks to it over HTTP and gloo.
#   tools/sglang_cpu/setup.sh [VENV_DIR]      default ~/.cache/earl-sglang-cpu; 3-5 minutes
# SGLANG_VERSION overrides the tested version. Idempotent: an existing venv is updated.
# Progress: a '[sglang-cpu mm:ss] ...' line per phase (the time since the start), and pip's own
# output in between (its download bars on a terminal, a line per package otherwise).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-$HOME/.cache/earl-sglang-cpu}
version=${SGLANG_VERSION:-0.5.23}
SECONDS=0
phase() { printf '[sglang-cpu %02d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }
if [[ -x $venv/bin/python ]]; then
    phase "updating the venv $venv"
else
    phase "creating the venv $venv"
    python3 -m venv "$venv"
fi
phase "pip install sglang==$version (~11 GB with its own torch; pip's output follows)"
"$venv/bin/python" -m pip install "sglang==$version"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# SGLang's CPU path imports one vllm op; vllm itself needs CUDA: install our stand-in instead
phase "installing the one-op vllm stand-in into $site"
rm -rf "$site/vllm"
cp -r "$here/vllm" "$site/vllm"
# SGLang's LoRA pins host memory unconditionally; on a CPU server pinning is a no-op (the
# module's docstring), switched on per server by EARL_SGLANG_CPU_PINNING=off
phase "installing the CPU pinning shim for SGLang's LoRA (earl_cpu_pinning.py + .pth)"
cp "$here/earl_cpu_pinning.py" "$site/earl_cpu_pinning.py"
echo 'import os; os.environ.get("EARL_SGLANG_CPU_PINNING") == "off" and __import__("earl_cpu_pinning")' > "$site/earl_cpu_pinning.pth"
phase "importing sglang and the stand-in once (checks the install; the first import is slow)"
"$venv/bin/python" -c "import sglang, vllm._custom_ops, earl_cpu_pinning; print('SGLang', sglang.__version__, 'ready:', '$venv/bin/python')"
phase "done"
echo "use it: make test-sglang, or rollout.engine=sglang rollout.sglang_device=cpu rollout.sglang_python=$venv/bin/python"
