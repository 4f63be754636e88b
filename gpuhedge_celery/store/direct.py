"""Direct dispatch: a caller that finds a GPU free and nobody waiting claims it itself.

A pooled request normally takes two Celery hops before its job starts: the caller's message to
a coordination worker, which waits in the pool's queue and claims a lease, then the lease's
job to the GPU's own queue. When the pool's wait queue is empty and one of its GPUs is free,
the wait is empty too, and the first hop buys nothing: :class:`DirectClaims` lets the caller
claim that GPU in one script (``lua/pooled_direct.lua``), which also records the request as
handed to the GPU (``store/pooled.py``), and the caller sends the job straight to the GPU's
queue. When anybody waits, or no GPU is free, the claim declines and the request takes the
queue as usual, so a direct claim never takes a GPU while a request is queued for the pool (a
request still on its way to the queue, such as one a GPU job sent back to waiting or the
sweep sent again, is not queued yet: it can be overtaken, as by any request that queues
first).

What keeps this as safe as the queued path: the record is written in the same script as the
lease, so a caller that dies before its message goes out leaves a handed record under a lease
nobody renews, and the reconcile pass sends the request again once that lease has ended
(``tasks/pooled_sweep.py``); a message that cannot be published gives the GPU back and forgets
the record at once. The GPU's host must have heartbeated (checked in the script) and the GPU
must not be out of the pool (drained, unhealthy, its model not loaded).

The pool's registered GPUs (ids, hosts, labels) are read at most once per
:data:`CANDIDATES_S` per process; registration, liveness and freedom are checked again in the
script itself. The lease's start time is Redis's clock, not the caller's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..core.lease_rules import DEFAULT_POOL_TTL_MS, Lease
from ..errors import GpuHedgeError
from .leases import GpuInfo, LeaseStore
from .pooled import PooledRecords, record_data, recordable
from .scripts import lua_script
from .timers import as_text, store_errors

CANDIDATES_S = 2.0  # how long a process reuses a pool's list of registered GPUs


class DirectClaims:
    """Direct claims on one deployment's lease table (see the module docstring)."""

    def __init__(self, store: LeaseStore, records: PooledRecords):
        self.store = store
        self.records = records
        self._gpus: dict[str, tuple[float, list[GpuInfo]]] = {}
        self._lock = threading.Lock()

    def claim(self, request_id: str, args: Any, kwargs: Any, queue: str | None) -> Lease | None:
        """Claim a free GPU of ``kwargs["pool"]`` for the request and record it as handed, or
        None when it should wait in the queue (someone waits, nothing free, an unknown pool).

        Safe to call again for the same request after a lost reply: a request this script
        already claimed for gets the same lease back, never a second GPU."""
        pool, labels = kwargs.get("pool", "default"), kwargs.get("labels") or {}
        if not recordable(pool) or not isinstance(labels, dict):
            return None  # the queued path refuses it with a one-line ConfigError
        candidates = [
            g
            for g in self._registered(pool)
            if all(g.labels.get(a) == b for a, b in labels.items())
        ]
        if not candidates:
            return None  # the queued path raises UnknownPool / EmptyPool with their reasons
        k = self.store.keys
        records = self.records.of(pool)
        records.note()
        keys = [  # all on the pool's hash tag: one slot
            records.record_key(request_id),
            records.handed_key,
            k.waiters(pool),
            k.pool_ttl(pool),
            k.freeat(pool),
        ]
        for g in candidates:
            keys += [
                k.lease(pool, g.gpu_id),
                k.fence(pool, g.gpu_id),
                k.out(pool, g.gpu_id),
                k.pool_host(pool, g.host),
                k.gpu(pool, g.gpu_id),
            ]
        args_ = [
            request_id,
            record_data(request_id, args, kwargs, queue),
            self.records.ttl_ms,
            pool,
            DEFAULT_POOL_TTL_MS,
        ] + [g.gpu_id for g in candidates]
        with store_errors(f"claiming a GPU of pool {pool!r} for request {request_id!r}"):
            reply = lua_script(self.store.client, "pooled_direct")(keys=keys, args=args_)
        if int(reply[0]) != 1:
            return None
        gpu_id, token, ttl, since = as_text(reply[1]), int(reply[2]), int(reply[3]), int(reply[4])
        return Lease(gpu_id, pool, token, request_id, ttl, since)

    def undo(self, lease: Lease) -> None:
        """The job's message could not be sent: give the GPU back and forget the record."""
        try:
            self.store.release(lease)
        except GpuHedgeError:  # already gone, or Redis away: the lease's TTL frees it
            pass
        try:
            self.records.of(lease.pool).forget(lease.holder)
        except GpuHedgeError:  # Redis away: the record stays handed under a lease now free,
            pass  # and the sweep sends the request again (the caller saw the error: it may too)

    def _registered(self, pool: str) -> list[GpuInfo]:
        now = time.monotonic()
        with self._lock:
            found = self._gpus.get(pool)
            if found is not None and now - found[0] < CANDIDATES_S:
                return found[1]
        gpus = self.store.gpus(pool, live_only=False)
        with self._lock:
            self._gpus[pool] = (now, gpus)
        return gpus
