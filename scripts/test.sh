#!/usr/bin/env bash
# The whole test suite, on a fresh machine with Python and pip:
#   installs the package with its test extras into the active interpreter, makes sure a real
#   redis-server and a real RabbitMQ are reachable (starting or apt-installing them), apt-installs
#   the checkers that are missing (systemd-analyze, espeak-ng), unpacks Prometheus and promtool
#   into a private directory (scripts/ensure-prometheus.sh: never installed, no service), lints
#   with ruff, type-checks with mypy, then runs pytest (printing the 25 slowest tests). Extra args
#   go to pytest (one module: tests/test_readme.py). Modules marked `sentinel` also run on a
#   Sentinel group that pytest starts from the same redis-server (tests/support/sentinel.py).
# --fast (first argument): the tests that need no server and start no process (pytest --fast,
#   tests/support/tiers.py) on two pytest-xdist processes after the same install, lint and type
#   check; none of the apt, Redis, RabbitMQ or Prometheus set-up, which only the other tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
FAST=0
if [ "${1:-}" = "--fast" ]; then
  FAST=1
  shift
fi
python3 -m pip install -q --disable-pip-version-check -e '.[test]'

if [ "$FAST" -eq 1 ]; then
  python3 -m ruff check .
  python3 -m ruff format --check .
  python3 -m mypy
  # two processes: most of a fast test is CPU or a deliberate wait, so two cores overlap them
  exec python3 -m pytest -q --fast -n 2 --durations=10 "$@"
fi

# Debian packages the tests run, installed quietly and only where missing.
need_apt() {  # need_apt COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 && return 0
  echo "test.sh: $1 not found; installing $2 with apt-get" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$2"; } \
    >/dev/null 2>&1 || echo "test.sh: could not install $2 (the tests that need $1 will fail)" >&2
}
need_apt systemd-analyze systemd   # tests/test_deploy.py verifies the systemd units
need_apt espeak-ng espeak-ng       # tests/test_tts_command.py: real speech behind a cmd: runner

GPUHEDGE_TEST_REDIS_URL="$(bash scripts/ensure-redis.sh)"
GPUHEDGE_TEST_AMQP_URL="$(bash scripts/ensure-rabbitmq.sh)"
export GPUHEDGE_TEST_REDIS_URL GPUHEDGE_TEST_AMQP_URL
echo "tests use Redis at $GPUHEDGE_TEST_REDIS_URL and RabbitMQ at $GPUHEDGE_TEST_AMQP_URL"
PATH="$(bash scripts/ensure-prometheus.sh):$PATH"
export PATH
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
python3 -m pytest -q --durations=25 "$@"
