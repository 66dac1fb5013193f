#!/usr/bin/env bash
# A separate venv in which a real SGLang server serves tiny models on a CPU-only machine (the
# project's opt-in SGLang tests and CPU demos). SGLang pins its own torch (~11 GB of packages),
# so it never shares the project's venv; the trainer talks to it over HTTP and gloo.
#   tools/sglang_cpu/setup.sh [VENV_DIR]      default ~/.cache/earl-sglang-cpu; 3-5 minutes
# SGLANG_VERSION overrides the tested version. Idempotent: an existing venv is updated.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-$HOME/.cache/earl-sglang-cpu}
version=${SGLANG_VERSION:-0.5.23}
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "sglang==$version"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# SGLang's CPU path imports one vllm op; vllm itself needs CUDA: install our stand-in instead
rm -rf "$site/vllm"
cp -r "$here/vllm" "$site/vllm"
"$venv/bin/python" -c "import sglang, vllm._custom_ops; print('SGLang', sglang.__version__, 'ready:', '$venv/bin/python')"
echo "use it: make test-sglang, or rollout.engine=sglang rollout.sglang_device=cpu rollout.sglang_python=$venv/bin/python"
