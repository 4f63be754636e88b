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


@pytest.fixture
def on_cluster(redis_url) -> bool:
    """Whether this test's store is on a Redis Cluster (a module's ``[cluster]`` run), for the
    few assertions whose figures a cluster changes (round trips split by slot)."""
    from gpuhedge_celery.redis_url import is_cluster

    return is_cluster(redis_url)
