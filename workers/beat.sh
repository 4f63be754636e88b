#!/usr/bin/env bash
# Celery beat: schedules gpuhedge.reconcile every GPUHEDGE_RECONCILE_INTERVAL_S (default 30 s).
# Run exactly one beat per deployment (the pass also takes a short lock, so an accidental second
# beat is harmless, only wasteful).
set -euo pipefail
exec "${PYTHON:-python3}" -m celery -A gpuhedge_celery beat --loglevel "${LOGLEVEL:-INFO}" \
  --schedule "${GPUHEDGE_BEAT_SCHEDULE:-/tmp/gpuhedge-beat-schedule}" "$@"
