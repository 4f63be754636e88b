#!/usr/bin/env bash
# Celery beat: schedules gpuhedge.reconcile every GPUHEDGE_RECONCILE_INTERVAL_S (default 30 s).
# Run exactly one beat per deployment (the pass also takes a short lock, so an accidental second
# beat is harmless, only wasteful). Its schedule file: GPUHEDGE_BEAT_SCHEDULE, by default under
# $XDG_STATE_HOME (~/.local/state)/gpuhedge-celery/, never the working directory.
set -euo pipefail
exec "${PYTHON:-python3}" -m celery -A gpuhedge_celery beat --loglevel "${LOGLEVEL:-INFO}" "$@"
