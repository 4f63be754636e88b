#!/usr/bin/env bash
# The coordination worker: pooled_infer waits here for a free GPU (a blocked thread per waiting
# request, one Redis pub/sub connection per process), and the reconcile pass runs here.
# Threads pool with GPUHEDGE_COORD_CONCURRENCY threads (default 32) comes from the app's config.
set -euo pipefail
exec "${PYTHON:-python3}" -m celery -A gpuhedge_celery worker -n "coord@$(hostname -s)" \
  --loglevel "${LOGLEVEL:-INFO}" "$@"
