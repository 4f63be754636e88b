#!/usr/bin/env bash
# Start one gpuhedge GPU worker per GPU of this host (one process per GPU: CUDA cannot be
# re-initialised in a forked child, and one job per GPU at a time is the point of the pool).
#
#   GPUHEDGE_REDIS_URL=redis://redis:6379/0 GPUHEDGE_POOL=a100 \
#   GPUHEDGE_RUNNER='cmd:python3 -m my_model.serve_once' workers/gpu-host.sh
#
# GPUs: GPUHEDGE_GPUS=0,1 (or "auto", the default: nvidia-smi). Each worker gets
# GPUHEDGE_GPU=<index> and CUDA_VISIBLE_DEVICES=<index>, consumes only gpuhedge.gpu.<host>:<index>
# and heartbeats. If any worker exits, the others are stopped too and the script exits non-zero,
# so a supervisor (systemd, Kubernetes) restarts the host's workers as a unit.
set -euo pipefail
PYTHON=${PYTHON:-python3}
mapfile -t GPUS < <("$PYTHON" - <<'PY'
import os
from gpuhedge_celery.gpus import discover_gpus
for gpu in discover_gpus(os.environ.get("GPUHEDGE_GPUS", "auto")):
    print(gpu.index)
PY
)
if [ "${#GPUS[@]}" -eq 0 ]; then
  echo "gpu-host: no GPU found (set GPUHEDGE_GPUS=0,1,... or install nvidia-smi)" >&2
  exit 2
fi
HOST=${GPUHEDGE_HOST:-$(hostname -s)}
pids=()
for index in "${GPUS[@]}"; do
  GPUHEDGE_GPU="$index" GPUHEDGE_HOST="$HOST" CUDA_VISIBLE_DEVICES="$index" \
    "$PYTHON" -m celery -A gpuhedge_celery worker -n "gpu${index}@${HOST}" \
      --loglevel "${LOGLEVEL:-INFO}" --without-gossip --without-mingle "$@" &
  pids+=("$!")
  echo "gpu-host: started worker for GPU ${HOST}:${index} (pid $!)" >&2
done
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
trap stop TERM INT
set +e
wait -n "${pids[@]}"
status=$?
stop
wait
exit $(( status == 0 ? 1 : status ))
