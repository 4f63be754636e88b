#!/usr/bin/env bash
# The GPU workers' checks on a host with an NVIDIA GPU (the test suite runs them on the CPU,
# with NVML's answers replayed from tests/data/nvml/). Run it from a clone on a GPU host:
#   bash scripts/gpu-check.sh            (GPU_CHECK_OUT=DIR keeps its output there)
#   GPU_CHECK_SKIP_INSTALL=1 bash scripts/gpu-check.sh   (on a host without a package index)
# 1. nvidia-smi and NVML through nvidia-ml-py: the host's answers recorded to
#    $GPU_CHECK_OUT/nvml-answers.json and judged by the health rules;
# 2. a real GPU worker with the tiny PyTorch network warm in its child: CUDA in the child only,
#    one load for every job, the worker's own NVML health reading, drain/undrain mid-job;
# 3. the GPU workers' test modules, now with CUDA in the worker's child.
# Exit status: non-zero if any check failed. Record what it prints in docs/gpu-workers.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check: nvidia-smi not found: run this on a host with an NVIDIA GPU and its driver" >&2
  exit 2
fi
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv
# GPU_CHECK_SKIP_INSTALL=1: the package and its test extras are installed already (a GPU host
# with no route to a package index)
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q --disable-pip-version-check -e '.[test,gpu]'
fi
GPUHEDGE_TEST_REDIS_URL="$(bash scripts/ensure-redis.sh)"
export GPUHEDGE_TEST_REDIS_URL GPUHEDGE_TEST_BROKER=redis
export GPU_CHECK_OUT="${GPU_CHECK_OUT:-$(mktemp -d -t gpu-check-XXXXXX)}"
status=0
python3 scripts/gpu_check.py || status=$?
python3 -m pytest -q tests/test_gpu_health.py tests/test_model_runners.py \
  tests/test_pool_models.py tests/test_pool_server.py || status=$?
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available())"
exit "$status"
