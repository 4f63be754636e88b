"""The sim adapter's ledger: what every process must agree on about a sim job's fate.

A sim job's timeline is drawn at submit and carried in its handle; only events that happen
later (a cancellation, an observed end) need shared memory. The interface is three Redis-shaped
operations on string keys with small JSON values, so the Celery layer backs it with Redis in a
few lines (``GET``, ``SET key value NX EX ttl``, ``INCR``); :class:`MemoryLedger` is the
in-process default and :class:`RedisLedger` the shared one.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from ..store.keys import under


class SimLedger(Protocol):
    """Shared memory of sim job fates across processes: string keys, small JSON string values.

    Three operations map one-to-one onto Redis (``GET``, ``SET NX EX``, ``INCR``), so a Redis
    ledger is a few lines; :class:`MemoryLedger` is the in-process default.
    """

    def get(self, key: str) -> str | None:
        """The value stored at ``key``, or None."""

    def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        """Store ``value`` unless ``key`` exists; True when stored (first writer wins)."""

    def incr(self, key: str) -> int:
        """Atomically add one to the integer at ``key`` (starting from 0) and return it."""


class MemoryLedger:
    """A :class:`SimLedger` in this process's memory (thread-safe; TTLs are ignored)."""

    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._data.get(key)

    def get_many(self, keys: list[str]) -> list[str | None]:
        with self._lock:
            return [self._data.get(key) for key in keys]

    def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        with self._lock:
            if key in self._data:
                return False
            self._data[key] = value
            return True

    def incr(self, key: str) -> int:
        with self._lock:
            value = int(self._data.get(key, "0")) + 1
            self._data[key] = str(value)
            return value


_default_ledger: SimLedger = MemoryLedger()

#: how long ledger records live where the ledger supports expiry (results are kept ~30 min)
LEDGER_TTL_S = 24 * 3600.0


def set_default_ledger(ledger: SimLedger) -> None:
    """Make ``ledger`` the one every sim provider without an explicit ledger uses (e.g. Redis)."""
    global _default_ledger
    _default_ledger = ledger


def get_default_ledger() -> SimLedger:
    """The ledger sim providers use when none was given to them."""
    return _default_ledger


def cancel_key(provider: str, job_id: str) -> str:
    """Ledger key holding a job's cancellation: ``{"sent": epoch_s, "terminal": epoch_s}``."""
    return f"sim:cancel:{provider}:{job_id}"


def done_key(provider: str, job_id: str) -> str:
    """Ledger key recording a job's observed natural end: ``{"state": ..., "at": epoch_s}``."""
    return f"sim:done:{provider}:{job_id}"


def seq_key(provider: str) -> str:
    """Ledger counter numbering a provider's submissions that carry no ``sim_key``."""
    return f"sim:seq:{provider}"


class RedisLedger:
    """A :class:`SimLedger` over Redis, shared by every process on the same server.

    ``client`` is a redis-py client built with ``decode_responses=True`` (this module does not
    import redis: building clients is the store layer's job, lazily per process). Keys are
    ``<prefix>:<ledger key>``.
    """

    def __init__(self, client: Any, prefix: str = "gpuhedge"):
        self.client = client
        self.prefix = prefix

    def _key(self, key: str) -> str:
        return under(self.prefix, key)

    def get(self, key: str) -> str | None:
        return self.client.get(self._key(key))

    def get_many(self, keys: list[str]) -> list[str | None]:
        """Several :meth:`get` in one round trip (``MGET``; on a Redis Cluster one per slot,
        whose ``MGET`` must keep to one)."""
        mget = getattr(self.client, "mget_nonatomic", None) or self.client.mget
        return list(mget([self._key(k) for k in keys])) if keys else []

    def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        ttl_ms = int(ttl_s * 1000) if ttl_s else None
        return bool(self.client.set(self._key(key), value, nx=True, px=ttl_ms))

    def incr(self, key: str) -> int:
        return int(self.client.incr(self._key(key)))
