#!/usr/bin/env bash
# Run every benchmark once, each printing JSON, into one folder (default bench-results/), so the
# figures in docs/benchmarks.md come from one run on one machine. Each bench compares against its
# baseline inside the same run (keyspace vs polling vs RTT; lease vs ideal/round-robin/least-conn;
# race overhead vs a plain Celery round trip, CPU per race vs a plain task returning the same
# payload). Not a test: it asserts nothing.
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
# Per-job overhead of a warm in-process model, a model server and a cmd: cold start, beside the
# pool's floor (a zero-length cpu job); the model and server are tests/support's (needs torch).
port="$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
py="$(command -v python3)"
run pool-runners pool --runner cpu:fixed=0 --runner python:tests.support.tiny_model:TinyModel \
  --runner "server:http://127.0.0.1:$port/v1/completions" \
  --runner "cmd:$py $PWD/tests/support/tiny_model.py" \
  --server-cmd "$py $PWD/tests/support/model_server.py --port $port"
run races races --rows overhead,capacity,cancel,floor  # floor: a plain Celery task with the same payload
run races-metrics races --rows metrics  # CPU per race, metrics off vs on, alternating
python3 scripts/bench_table.py "$out"
