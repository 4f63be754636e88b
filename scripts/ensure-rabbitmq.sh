#!/usr/bin/env bash
# Make sure a real RabbitMQ is reachable for the tests and print its AMQP URL on stdout.
#   1. GPUHEDGE_TEST_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672//) answers -> use it
#   2. otherwise start the machine's server with `rabbitmq-server -detached`, installing
#      Debian's rabbitmq-server with apt-get first if it is missing, and wait for it
# The tests also need `rabbitmqctl` (they make a vhost per test cluster), which comes with the
# server package. Diagnostics go to stderr; exit 1 if no server can be had (tests never skip).
set -euo pipefail

url="${GPUHEDGE_TEST_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672//}"

answers() {
  python3 - "$1" <<'PY' >/dev/null 2>&1
import sys
from kombu import Connection
with Connection(sys.argv[1], connect_timeout=1) as conn:
    conn.connect()
PY
}

if answers "$url"; then
  echo "$url"; exit 0
fi

if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "ensure-rabbitmq: rabbitmq-server not found; installing it with apt-get" >&2
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq rabbitmq-server >&2 || true
  fi
fi
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "ensure-rabbitmq: no RabbitMQ reachable at $url and none could be installed" >&2
  exit 1
fi

# The package may have started it already (where the container has an init system).
if ! answers "$url"; then
  echo "ensure-rabbitmq: starting rabbitmq-server (detached)" >&2
  rabbitmq-server -detached >&2 || true
fi
deadline=$((SECONDS + 90))  # an Erlang node takes a few seconds to boot
while [ "$SECONDS" -lt "$deadline" ]; do
  if answers "$url"; then
    echo "ensure-rabbitmq: RabbitMQ answers at $url" >&2
    echo "$url"; exit 0
  fi
  sleep 0.5
done
echo "ensure-rabbitmq: started rabbitmq-server but $url never answered (see /var/log/rabbitmq)" >&2
exit 1
