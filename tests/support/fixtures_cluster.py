"""A Redis Cluster of the whole run (tests/support/redis_cluster.py): three masters on loopback,
started by its first user. Fails (never skips) when it cannot start."""

from __future__ import annotations

import pytest

from tests.support.redis_cluster import LocalCluster


@pytest.fixture(scope="session")
def redis_cluster():
    cluster = LocalCluster()
    try:
        cluster.start()
    except RuntimeError as e:
        pytest.fail(f"no Redis Cluster for the tests: {e}")
    yield cluster
    cluster.stop()
