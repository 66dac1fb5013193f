#!/usr/bin/env bash
# Wheels the one-GPU check (benchmarks/gpu_check.py) needs on a GPU host that has torch with
# CUDA but none of the project's other dependencies and no package index (a lent machine, an
# air-gapped node). Run here, with the index; carry .whl/ to the GPU host; gpu_check.py installs
# them into a private --target and puts the repo on PYTHONPATH.
#   tools/gpu_wheels.sh [DIR] [PYTHON_VERSION]      defaults: .whl, 3.12   (~20 MB)
# Versions are this checkout's tested ones (.venv's). antlr4-python3-runtime 4.9.3 (OmegaConf's
# parser) is published as source only: it is built here into a pure-Python wheel.
set -euo pipefail
dir=${1:-.whl}
pyver=${2:-3.12}
mkdir -p "$dir"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
done
binary=(megatron-core==0.16.1 open_spiel==2.0.2 hydra-core==1.3.8 omegaconf==2.3.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp "${plat[@]}" -d "$dir" "${binary[@]}"
python3 -m pip wheel -q --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
ls -1 "$dir"
du -sh "$dir"
