"""Redis clients built lazily per process, with driver errors translated at the boundary.

Never build a client at import time: a forked Celery worker would inherit the parent's socket.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any, cast

import redis
import redis.sentinel
from redis.exceptions import ClusterDownError, ClusterError, SlotNotCoveredError

from ..errors import StoreUnavailable
from ..redis_url import is_cluster, is_sentinel, parse_cluster_url, parse_sentinel_url, redact_url
from .cluster import ClusterClient

_clients: dict[tuple[int, str, bool], redis.Redis] = {}


def client_for(url: str, *, decode_responses: bool = True, **kwargs: Any) -> redis.Redis:
    """A redis-py client for ``url``, cached per process (rebuilt after a fork)."""
    key = (os.getpid(), url, decode_responses)
    client = _clients.get(key)
    if client is None:
        kwargs.setdefault("socket_connect_timeout", 5)
        kwargs.setdefault("health_check_interval", 30)
        client = redis_from_url(url, decode_responses=decode_responses, **kwargs)
        _clients[key] = client
    return client


def redis_from_url(url: str, **kwargs: Any) -> redis.Redis:
    """A new redis-py client for ``url``: ``redis.Redis.from_url`` for one server; for a
    ``sentinel://`` URL a client of the group's primary, which asks the Sentinels where the
    primary is on every (re)connect and so follows a failover; for a ``redis+cluster://`` URL
    a :class:`~gpuhedge_celery.store.cluster.ClusterClient` (the one place clients are built
    from a URL)."""
    if is_cluster(url):
        # it answers every command the store sends, and its pipelines keep to one slot
        return cast(redis.Redis, ClusterClient.from_spec(parse_cluster_url(url), **kwargs))
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    spec = parse_sentinel_url(url)
    common = {k: kwargs[k] for k in _SENTINEL_SHARED if k in kwargs}
    sentinel_kwargs: dict[str, Any] = dict(common)
    if spec.sentinel_password:
        sentinel_kwargs["password"] = spec.sentinel_password
    if spec.ssl:
        sentinel_kwargs["ssl"] = kwargs["ssl"] = True
        if spec.ssl_ca_certs:
            sentinel_kwargs["ssl_ca_certs"] = kwargs["ssl_ca_certs"] = spec.ssl_ca_certs
    group = redis.sentinel.Sentinel(list(spec.sentinels), sentinel_kwargs=sentinel_kwargs)
    if spec.username:
        kwargs.setdefault("username", spec.username)
    if spec.password is not None:
        kwargs.setdefault("password", spec.password)
    return group.master_for(spec.master, db=spec.db, **kwargs)


# what a Sentinel connection shares with the data nodes' (never the data nodes' credentials)
_SENTINEL_SHARED = ("socket_connect_timeout", "socket_timeout", "retry")


def client_location(client: Any) -> str:
    """Where ``client`` connects, as a URL without credentials: ``rediss://`` for TLS, so an
    error about a TLS Redis does not name a plain ``redis://`` one."""
    if isinstance(client, ClusterClient):
        return client.location
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        hosts = ",".join(f"{host}:{port}" for host, port in _sentinels(pool))
        return f"sentinel://{hosts}/{kw.get('db', 0)} (master {pool.service_name})"
    if kw.get("path"):
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    tls = isinstance(pool.connection_class, type) and issubclass(
        pool.connection_class, redis.SSLConnection
    )
    scheme = "rediss" if tls else "redis"
    return f"{scheme}://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def reset_clients() -> None:
    """Forget cached clients (call in ``worker_process_init`` after a fork)."""
    _clients.clear()


@contextlib.contextmanager
def translate_errors(url: str | None = None) -> Iterator[None]:
    """Turn redis-py connection/auth errors into :class:`StoreUnavailable` with one clear line."""
    try:
        yield
    except redis.AuthenticationError as e:
        where = f" at {redact_url(url)}" if url else ""
        raise StoreUnavailable(f"Redis{where} refused our credentials: {e}") from e
    except (redis.ConnectionError, redis.TimeoutError) as e:
        where = f" at {redact_url(url)}" if url else ""
        raise StoreUnavailable(
            f"Redis{where} is unreachable ({e}); set GPUHEDGE_REDIS_URL or --redis-url"
        ) from e
    except (ClusterError, SlotNotCoveredError) as e:  # a cluster not serving a slot now
        where = f" at {redact_url(url)}" if url else ""
        raise StoreUnavailable(f"Redis Cluster{where} is not serving ({e})") from e
    except redis.ResponseError as e:
        if not primary_changed(e):
            raise
        where = f" at {redact_url(url)}" if url else ""
        raise StoreUnavailable(f"Redis{where} stopped being the primary ({e})") from e


# How Redis answers a client still on a primary that a failover demoted: a write refused
# (READONLY), or a WAIT cut short by the demotion (UNBLOCKED ... master -> replica)
_PRIMARY_CHANGED = ("READONLY", "UNBLOCKED")


def primary_changed(error: redis.ResponseError) -> bool:
    """Whether ``error`` says the server stopped being the primary: a retry, once the client
    reconnects to the new one, is all it needs (an outage, not a bug in the command)."""
    if isinstance(error, redis.ReadOnlyError | ClusterDownError):  # a cluster's failover
        return True
    message = str(error)
    # a pipeline wraps the server's answer: "Command # 2 (WAIT 1 200) of pipeline caused error: ..."
    answer = message.partition("caused error: ")[2] or message
    return answer.startswith(_PRIMARY_CHANGED)


def ping(url: str) -> None:
    """Raise :class:`StoreUnavailable` unless Redis at ``url`` answers PING."""
    with translate_errors(url):
        client_for(url).ping()


def wait_for_redis(client: redis.Redis, limit_s: float, interval_s: float = 0.5) -> bool:
    """Block until ``client``'s Redis answers PING (True), at most ``limit_s`` (False).

    For work that lost Redis mid-way (an outage, a restart) and must still report what became
    of it once Redis is back, rather than fail with the connection error.
    """
    deadline = time.monotonic() + limit_s
    while True:
        try:
            client.ping()
            return True
        except redis.RedisError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval_s)


def _servers(client: Any) -> list[tuple[str, Any]]:
    """``(name, client)`` of each server whose own settings count: the one Redis (no name), or
    every primary of a cluster (``host:port``: each keeps its own slots' keys)."""
    if isinstance(client, ClusterClient):
        return client.primary_clients()
    return [("", client)]


def _on(name: str) -> str:
    return f"Redis {name}" if name else "Redis"


def persistence_warning(client: Any) -> str | None:
    """A one-line warning when Redis (any primary of a cluster) would lose races and leases in
    a restart, else None.

    Without AOF a restarted Redis comes back empty (or at its last RDB snapshot): races in
    flight lose their state, their callers get an explicit failure only at their deadline
    (``RaceResult``), and the provider jobs they had submitted can no longer be found or
    cancelled by the janitor. Managed Redis that forbids ``CONFIG`` is not judged here.
    """
    lacking = []
    for name, server in _servers(client):
        try:
            info = server.info("persistence")
            save = server.config_get("save").get("save", "")
        except redis.RedisError:
            continue
        if not int(info.get("aof_enabled", 0) or 0):
            lacking.append((name, save))
    if not lacking:
        return None
    name, save = lacking[0]
    kept = f"only RDB snapshots ({save!r})" if save else "no persistence at all"
    more = f" (and {len(lacking) - 1} more primaries)" if len(lacking) > 1 else ""
    return (
        f"{_on(name)}{more} keeps {kept}: a restart loses the races in flight (their callers fail "
        "at their deadline) and the provider jobs they submitted can no longer be found or "
        "cancelled; set 'appendonly yes' and 'appendfsync everysec' (docs/reliability.md)"
    )


def replication_warning(client: Any, wait_replicas: int) -> str | None:
    """A one-line warning when a primary has more replicas than a winner waits for: while a
    failover promotes one replica, another may still follow the old primary and acknowledge a
    claim the promoted one never gets (measured: ``tests/test_failover_e2e.py``)."""
    most, where = 0, ""
    for name, server in _servers(client):
        try:
            replicas = int(server.info("replication").get("connected_slaves", 0) or 0)
        except redis.RedisError:
            continue
        if replicas > most:
            most, where = replicas, name
    if most == 0 or wait_replicas >= most:
        return None
    return (
        f"{_on(where)} has {most} replicas and GPUHEDGE_REDIS_WAIT_REPLICAS is {wait_replicas}: "
        "a winner or a reservation acknowledged by fewer than all of them can still be lost in "
        f"a failover; set it to {most} (docs/operations.md, Failover)"
    )


def same_database(a: Any, b: Any) -> bool:
    """Whether two redis-py clients reach the same Redis database (host and port, or unix
    socket, and db number): a script run through one may then write keys the other reads."""

    def where(client: Any) -> tuple[Any, ...] | None:
        if isinstance(client, ClusterClient):  # a cluster, known by its seed nodes
            return "cluster", tuple(sorted(client.spec.nodes))
        pool = getattr(client, "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", None)
        if not isinstance(kwargs, dict):
            return None
        if isinstance(pool, redis.sentinel.SentinelConnectionPool):  # the group's primary
            return pool.service_name, _sentinels(pool), int(kwargs.get("db") or 0)
        place = kwargs.get("path") or kwargs.get("host")
        if not place:  # a pool that does not say where it connects: not known
            return None
        return place, int(kwargs.get("port") or 6379), int(kwargs.get("db") or 0)

    found = where(a)
    return found is not None and found == where(b)


def database_number(client: Any) -> int:
    """The database ``client`` selects (a cluster has database 0 only)."""
    if isinstance(client, ClusterClient):
        return 0
    return int(client.connection_pool.connection_kwargs.get("db") or 0)


def _sentinels(pool: redis.sentinel.SentinelConnectionPool) -> tuple[tuple[str, int], ...]:
    """The Sentinels ``pool`` asks for its primary, as sorted (host, port) pairs."""
    found = []
    for sentinel in pool.sentinel_manager.sentinels:
        kwargs = sentinel.connection_pool.connection_kwargs
        found.append((str(kwargs.get("host")), int(kwargs.get("port") or 26379)))
    return tuple(sorted(found))
