#!/usr/bin/env bash
# Make sure a real redis-server is reachable for the tests and print its URL on stdout.
#   1. GPUHEDGE_TEST_REDIS_URL already set and answering  -> use it
#   2. the machine's server on 127.0.0.1:6379 answers    -> use it
#   3. otherwise start our own on a free port (installing redis-server with apt-get if missing)
# Diagnostics go to stderr; exit 1 if no server can be had (tests must not skip silently).
set -euo pipefail

ping_url() {
  python3 - "$1" <<'PY' >/dev/null 2>&1
import sys, redis
redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1).ping()
PY
}

if [ -n "${GPUHEDGE_TEST_REDIS_URL:-}" ] && ping_url "$GPUHEDGE_TEST_REDIS_URL"; then
  echo "$GPUHEDGE_TEST_REDIS_URL"; exit 0
fi
if ping_url "redis://127.0.0.1:6379/0"; then
  echo "redis://127.0.0.1:6379/0"; exit 0
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "ensure-redis: redis-server not found; installing it with apt-get" >&2
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >&2
  fi
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "ensure-redis: no redis-server reachable and none could be installed" >&2
  exit 1
fi

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
  --dir "$dir" --logfile "$dir/redis.log" --pidfile "$dir/redis.pid" >&2
for _ in $(seq 1 50); do
  if ping_url "redis://127.0.0.1:$port/0"; then
    echo "ensure-redis: started redis-server on 127.0.0.1:$port (pid file $dir/redis.pid)" >&2
    echo "redis://127.0.0.1:$port/0"; exit 0
  fi
  sleep 0.1
done
echo "ensure-redis: started redis-server on port $port but it never answered (see $dir/redis.log)" >&2
exit 1
