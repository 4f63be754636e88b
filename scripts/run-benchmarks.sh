#!/usr/bin/env bash
# Run every benchmark once, each printing JSON, into one folder (default bench-results/), so the
# figures in docs/benchmarks.md come from one run on one machine. Each bench compares against its
# baseline inside the same run (keyspace vs polling vs RTT; lease vs ideal/round-robin/least-conn;
# race overhead vs a plain Celery round trip). Not a test: it asserts nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results}"
mkdir -p "$out"
run() {  # run FILE BENCH [options]: one benchmark into $out/FILE.json
  local file="$1" name="$2"; shift 2
  echo "bench $name $*" >&2
  local t0=$SECONDS
  gpuhedge-celery bench "$name" --json "$@" > "$out/$file.json"
  echo "  done in $((SECONDS - t0)) s" >&2
}
run replay replay
run handoff handoff
run timers timers
run timers-threads8 timers --threads 8  # as race workers fire them (GPUHEDGE_TIMER_THREADS)
run pool pool
run races races
python3 scripts/bench_table.py "$out"
