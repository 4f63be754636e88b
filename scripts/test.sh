#!/usr/bin/env bash
# The whole test suite, on a fresh machine with Python and pip:
#   installs the package with its test extras, makes sure a real redis-server is reachable
#   (starting or installing one), lints with ruff, then runs pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check -e '.[test]'
GPUHEDGE_TEST_REDIS_URL="$(bash scripts/ensure-redis.sh)"
export GPUHEDGE_TEST_REDIS_URL
echo "tests use Redis at $GPUHEDGE_TEST_REDIS_URL"
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m pytest -q "$@"
