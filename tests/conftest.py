"""Fixtures shared by every test tier.

Tiers: pure tables (no fixtures), ``fake_redis`` (fakeredis, no expiry or events), ``redis_url`` /
``redis_client`` (a real redis-server: the machine's, or one started here; never skipped; for a
module's ``[sentinel]`` run, the run's Sentinel group), and real Celery worker processes
(fixtures in tests/support/fixtures_*.py). Each test is marked by what it uses
(tests/support/tiers.py); ``--fast`` runs only those that need no server or process.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import pathlib
import threading
import uuid

import pytest

from tests.support.redis_server import shared_redis_url, start_redis_server
from tests.support.tiers import TIER_MARKS, ProcessGuard, no_gc_pauses, tier_marks

# CPython 3.11 before 3.11.8 keeps the AST converter's recursion depth in state that every thread
# shares: two parses at once make either fail with "SystemError: AST constructor recursion depth
# mismatch", and pytest's own rendering then stops the run with an INTERNALERROR. A second parse
# comes from another thread (a test server formatting a traceback, which 3.11 does with ast.parse)
# or from this one, when a garbage collection during a long parse runs a finalizer that logs a
# traceback. Parses in this process take turns, with collection paused while each runs.
_AST_LOCK = threading.RLock()
_ast_parse = ast.parse


def _parse_in_turn(*args, **kwargs):
    with _AST_LOCK:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return _ast_parse(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()


ast.parse = _parse_in_turn

# Every tests/support/fixtures_*.py module is a fixture plugin.
pytest_plugins = sorted(
    f"tests.support.{p.stem}"
    for p in (pathlib.Path(__file__).parent / "support").glob("fixtures_*.py")
)


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help="only the fast tier: no redis-server, RabbitMQ, Celery workers or other processes",
    )


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    """Mark each test ``redis``/``celery``/``server`` by what it uses; ``fast`` when none and not
    ``slow`` (tests/support/tiers.py). ``--fast`` keeps only ``fast``."""
    with no_gc_pauses():
        marks = [(item, tier_marks(item)) for item in items]
    for item, earned in marks:
        for mark in sorted(earned):
            if item.get_closest_marker(mark) is None:
                item.add_marker(mark)
        if not any(item.get_closest_marker(m) for m in (*TIER_MARKS, "slow")):
            item.add_marker("fast")
    if config.getoption("--fast"):
        deselected = [item for item in items if item.get_closest_marker("fast") is None]
        items[:] = [item for item in items if item.get_closest_marker("fast") is not None]
        config.hook.pytest_deselected(items=deselected)


def _guarded(config):
    return ProcessGuard() if config.getoption("--fast") else contextlib.nullcontext()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item.config):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guarded(item.config):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with _guarded(item.config):
        return (yield)


@pytest.fixture(scope="session")
def plain_redis_url():
    """URL of a real redis-server. Fails (never skips) when none can be reached or started."""
    try:
        url, server = shared_redis_url()
    except RuntimeError as e:
        pytest.fail(f"no real redis-server for the tests: {e}")
    yield url
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def sentinel_group():
    """A Sentinel group of the whole run (tests/support/sentinel.py), started by its first user;
    the failover tests start groups of their own."""
    from tests.support.sentinel import SHARED_DOWN_AFTER_MS, SentinelGroup

    with SentinelGroup(down_after_ms=SHARED_DOWN_AFTER_MS) as group:
        yield group


@pytest.fixture(scope="module")
def redis_url(broker, plain_redis_url, request):
    """URL of the store's Redis: the plain redis-server, a ``sentinel://`` URL of the run's
    Sentinel group when the module runs on the ``sentinel`` broker (store, results and broker
    on the group: tests/support/fixtures_celery.py), or the run's Redis Cluster on ``cluster``
    (its broker and results on the plain redis-server)."""
    from gpuhedge_celery.redis_url import with_sentinel_options
    from tests.support.fixtures_celery import CLUSTER, SENTINEL

    if broker == CLUSTER:
        return request.getfixturevalue("redis_cluster").url
    if broker != SENTINEL:
        return plain_redis_url
    group = request.getfixturevalue("sentinel_group")
    return with_sentinel_options(group.url, group.master_name, group.sentinel_password)


@pytest.fixture
def redis_client(redis_url):
    from gpuhedge_celery.store.connection import redis_from_url

    client = redis_from_url(redis_url, decode_responses=True)
    yield client
    close_client(client)


@pytest.fixture
def prefix(redis_url):
    """A key prefix unique to this test; its keys are deleted afterwards."""
    from gpuhedge_celery.store.connection import redis_from_url

    value = f"t{uuid.uuid4().hex[:10]}"
    yield value
    client = redis_from_url(redis_url)
    try:
        keys = list(client.scan_iter(f"{value}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        close_client(client)


def close_client(client) -> None:
    """Close ``client`` and, for a Sentinel group's primary, its connections to the Sentinels
    (``Redis.close`` leaves those open until the garbage collector finds them)."""
    client.close()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        sentinel.close()


@pytest.fixture
def private_redis():
    """A redis-server of this test alone (for CONFIG changes, kills, restarts)."""
    try:
        server = start_redis_server()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield server
    server.stop()


@pytest.fixture
def fake_redis():
    import fakeredis

    return fakeredis.FakeRedis(decode_responses=True)
