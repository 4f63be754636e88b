"""Redis clients built lazily per process, with driver errors translated at the boundary.

Never build a client at import time: a forked Celery worker would inherit the parent's socket.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import redis

from ..errors import StoreUnavailable
from ..settings import redact_url

_clients: dict[tuple[int, str, bool], redis.Redis] = {}


def client_for(url: str, *, decode_responses: bool = True, **kwargs: Any) -> redis.Redis:
    """A redis-py client for ``url``, cached per process (rebuilt after a fork)."""
    key = (os.getpid(), url, decode_responses)
    client = _clients.get(key)
    if client is None:
        kwargs.setdefault("socket_connect_timeout", 5)
        kwargs.setdefault("health_check_interval", 30)
        client = redis.Redis.from_url(url, decode_responses=decode_responses, **kwargs)
        _clients[key] = client
    return client


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


def ping(url: str) -> None:
    """Raise :class:`StoreUnavailable` unless Redis at ``url`` answers PING."""
    with translate_errors(url):
        client_for(url).ping()
