"""Request budgets per provider route, shared by every worker process of a fleet through Redis.

A serverless platform limits requests per endpoint and route (RunPod: ``/run`` 1,000, ``/status``
2,000 and ``/cancel`` 100 per 10 s). Every Celery process of the fleet polls the same endpoint,
so a per-process limit cannot keep the fleet under it: one token bucket per endpoint and route
lives in Redis (``store/lua/rate_take.lua``, one script call per request) and every process
takes its tokens from it.

The bucket holds at most ``capacity`` tokens (the burst) and refills at ``rate`` tokens a
second. Whatever the timing of the requests, any window of ``window_s`` seconds then sees at
most ``capacity + rate * window_s`` of them sent on time; both are chosen so that this is
``use`` (default 0.9) of the documented limit: 10 % of it is the burst, the rest the refill.
The last 10 % is slack for requests that leave a little after their token was granted (a
thread switch, a connection being opened), which can move one into the next window.

A caller that finds the bucket empty may *reserve* the next token (the script returns how long
to wait) as long as that wait is within its ``max_wait_s``; a longer wait is refused without
taking anything, and the caller decides (a status poll is deferred, a cancel waits longer).

A caller that takes ``behind`` the others (the cancel of a job already running, behind the
cancels of queued jobs: a queued job stopped now costs nothing, a running one only its next
seconds) leaves ``hold`` tokens to them and never reserves: it is told when to come back.

The script reads Redis's own clock (``TIME``), so hosts sharing a bucket never disagree about
time. A Redis error never blocks a provider call: the limiter lets it through and logs (once a
minute) - the provider's own 429 and ``Retry-After`` are then the only brake.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

BURST_SHARE = 0.1  # of the limit: the bucket's capacity


@dataclass(frozen=True)
class RouteLimit:
    """A documented limit, ``limit`` requests per ``window_s`` seconds, and the share of it
    (``use``) the fleet aims to stay under in any window."""

    route: str
    limit: int
    window_s: float = 10.0
    use: float = 0.9

    @property
    def capacity(self) -> float:
        """Tokens the bucket holds when full (the burst)."""
        return float(max(1, math.floor(self.limit * BURST_SHARE)))

    @property
    def rate_per_s(self) -> float:
        """Refill, tokens per second: ``capacity + rate * window_s == use * limit``."""
        return max(self.limit * self.use - self.capacity, 0.5) / self.window_s

    @property
    def hold(self) -> float:
        """Tokens a taker ``behind`` the others leaves for them (half the burst): it is only
        granted a token free beyond these, never a reservation (see :class:`Limiter`)."""
        return max(0.0, min(self.capacity - 1, self.capacity // 2))  # a bucket of 1: no hold

    def most_per_window(self) -> float:
        """The most requests sent on time that any ``window_s`` window can hold."""
        return self.capacity + self.rate_per_s * self.window_s


@dataclass(frozen=True)
class Grant:
    """A limiter's answer: ``granted`` (send after ``wait_s``), or refused (a token is due in
    ``wait_s``; nothing was taken)."""

    granted: bool
    wait_s: float


class Limiter(Protocol):
    def take(
        self, scope: str, limit: RouteLimit, max_wait_s: float, *, behind: bool = False
    ) -> Grant: ...


class LocalLimiter:
    """The same bucket in this process only (``rate_limits.shared: false``; tests)."""

    def __init__(self, clock: Any = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], list[float]] = {}

    def take(
        self, scope: str, limit: RouteLimit, max_wait_s: float, *, behind: bool = False
    ) -> Grant:
        now = self._clock()
        cap, rate, hold = limit.capacity, limit.rate_per_s, limit.hold if behind else 0.0
        with self._lock:
            bucket = self._buckets.setdefault((scope, limit.route), [cap, now])
            tokens, ts = bucket
            if now > ts:
                tokens, ts = min(cap, tokens + (now - ts) * rate), now
            wait = (1 + hold - tokens) / rate if tokens - hold < 1 else 0.0
            if wait > max_wait_s or (hold and wait > 0):
                return Grant(False, wait)
            bucket[0], bucket[1] = tokens - 1, ts
            return Grant(True, wait)


class RedisLimiter:
    """The bucket in Redis (``rate_take.lua``), shared by every process on the same prefix."""

    def __init__(self, client: Any, prefix: str):
        from ..store.keys import Keys
        from ..store.scripts import lua_script

        self.client = client
        self.keys = Keys(prefix)
        self._script = lua_script(client, "rate_take")
        self._warned_at = 0.0

    def take(
        self, scope: str, limit: RouteLimit, max_wait_s: float, *, behind: bool = False
    ) -> Grant:
        # An idle bucket refills completely within capacity / rate; keep it a little longer.
        ttl_ms = int(1000 * (limit.capacity / limit.rate_per_s + max_wait_s + limit.window_s))
        args = [
            limit.capacity,
            limit.rate_per_s / 1000.0,
            max(0.0, max_wait_s) * 1000.0,
            ttl_ms,
            limit.hold if behind else 0,
        ]
        try:
            granted, wait_ms = self._script(
                keys=[self.keys.rate_bucket(scope, limit.route)], args=args
            )
        except Exception as e:  # never block provider calls on the limiter itself
            now = time.monotonic()
            if now - self._warned_at > 60:
                self._warned_at = now
                log.warning(
                    "rate limiter unavailable (%s: %s); requests pass unmetered",
                    type(e).__name__,
                    e,
                )
            return Grant(True, 0.0)
        return Grant(bool(int(granted)), int(wait_ms) / 1000.0)


_default: dict[str, Any] = {}
_default_lock = threading.Lock()


def default_limiter() -> Limiter:
    """This process's shared limiter on ``GPUHEDGE_REDIS_URL`` / ``GPUHEDGE_PREFIX`` (built on
    first use, never at import, and again after a fork)."""
    pid = os.getpid()
    found = _default.get("limiter")
    if found is None or _default.get("pid") != pid:
        with _default_lock:
            found = _default.get("limiter")
            if found is None or _default.get("pid") != pid:
                from .. import settings as process_settings
                from ..store.connection import client_for

                settings = process_settings.current().core
                found = RedisLimiter(client_for(settings.redis_url), settings.prefix)
                _default.update(limiter=found, pid=pid)
    return found
