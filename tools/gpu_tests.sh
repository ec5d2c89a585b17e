#!/usr/bin/env bash
# Run the GPU-marked tests (pytest -m gpus) on a machine that already has torch
# with CUDA. No venv is made. If megatron-core is not importable, its wheel is
# installed offline from .whl/ into a private target dir first:
#
#   mkdir -p .whl && pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
#   tools/gpu_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" -c 'import torch, sys; sys.exit(torch.cuda.device_count() == 0)' \
    || { echo "error: no CUDA GPU visible to $py; run this on a GPU machine." >&2; exit 1; }
source tools/mcore_path.sh
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'
exec "$py" -m pytest -m gpus tests/unit_tests -ra "$@"
