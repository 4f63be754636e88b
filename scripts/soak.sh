#!/usr/bin/env bash
# The soak (docs/reliability.md): hedged races at a steady rate on private workers and a private
# redis-server (AOF), pooled jobs on two GPU workers, a coordination worker kill -9'd every 30 s,
# one Redis kill -9 + restart. Prints one JSON object of counters (lost races, double winners,
# unflagged leaks, lost pooled jobs, double GPU holds, worker RSS and Redis memory over time).
# Default: a compressed ten minutes; --minutes 60 for the hour.
#   bash scripts/soak.sh [--minutes M] [--rate R] [--kill-every S] [--gpus N] [--gpu-rho F]
#                        [--receipt-ttl S] [--sample-every S] [--pool-workers N]
#                        [--records-maxlen N] [--reclaim-expired]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m tests.support.soak "$@"
