#!/usr/bin/env bash
# A coordination worker for pooled waits only (queue gpuhedge.pool): each pooled_infer waiting
# for a free GPU blocks one of its threads, so a GPU backlog fills these workers and never the
# threads races step on. Run the race coordinators with
# GPUHEDGE_COORD_QUEUES=gpuhedge.coord,gpuhedge.attempts beside it (docs/operations.md).
set -euo pipefail
export GPUHEDGE_COORD_QUEUES="${GPUHEDGE_COORD_QUEUES:-gpuhedge.pool}"
exec "${PYTHON:-python3}" -m celery -A gpuhedge_celery worker -n "pool@$(hostname -s)" \
  --loglevel "${LOGLEVEL:-INFO}" "$@"
