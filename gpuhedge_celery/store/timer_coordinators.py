"""The registry of timer coordinators: a lease per process that fires race timers, renewed by
its heartbeat and read back whole, so that each coordinator can work out its part of the race
shards (:func:`~gpuhedge_celery.core.shard_deal.dealt_shards`).

One ZSET per deployment (``<prefix>:{<namespace>-coordinators}``), coordinator id -> lease
expiry in the Redis server's time; one script renews a lease, drops the lapsed ones and lists
the rest in one round trip. A coordinator that dies stops renewing and drops out of every
other coordinator's deal once its lease lapses.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from .keys import under
from .race_keys import check_name
from .scripts import lua_script
from .timers import as_text, store_errors

LEASE_MS = 1_000  # a coordinator silent this long is dead to the others
BEAT_MS = 250  # how often a coordinator renews its lease and re-reads the deal
HELP_BEHIND_MS = 50  # a shard's timers this late are claimed by its helper too
HELP_EVERY_MS = 50  # how often a helper looks for them


def coordinator_id() -> str:
    """A fresh id naming this process (host and pid, for an operator reading the registry)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Coordinators:
    """The coordinators' leases under ``prefix`` for the timer namespace ``namespace``."""

    def __init__(self, client: Any, prefix: str, namespace: str = "races"):
        check_name(namespace, "timer namespace")
        self.client = client
        self.key = under(prefix, f"{{{namespace}-coordinators}}")
        self._beat = lua_script(client, "coordinator_beat")

    def beat(self, me: str, lease_ms: int = LEASE_MS) -> list[str]:
        """Renew ``me``'s lease for ``lease_ms``; the ids of every live coordinator, sorted."""
        if lease_ms < 1:
            raise ValueError(f"a coordinator's lease must be >= 1 ms, got {lease_ms}")
        return self._run(me, lease_ms)

    def leave(self, me: str) -> list[str]:
        """End ``me``'s lease (it stops firing timers); the coordinators left, sorted."""
        return self._run(me, 0)

    def live(self) -> list[str]:
        """The coordinators whose lease runs, without renewing any (for operators and tests)."""
        with store_errors("reading the timer coordinators"):
            t = self.client.time()
            now = int(t[0]) * 1000 + int(t[1]) // 1000
            return sorted(as_text(m) for m in self.client.zrangebyscore(self.key, now + 1, "+inf"))

    def _run(self, me: str, lease_ms: int) -> list[str]:
        with store_errors("renewing a timer coordinator's lease"):
            found = self._beat(keys=[self.key], args=[me, lease_ms])
        return sorted(as_text(m) for m in found)
