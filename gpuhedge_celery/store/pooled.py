"""Pooled requests' own records in Redis: what keeps a ``pooled_infer`` request from vanishing.

Until a coordination worker takes a pooled request, its only copy is its broker message, and a
broker message can be lost without trace:

* Redis with ``appendfsync everysec`` may lose the last second of writes when it is killed,
  the message's ``LPUSH`` among them;
* kombu's Redis transport pops a message (``BRPOP``) and records it as unacknowledged in a
  second step: a worker killed between the two takes the message with it.

So the caller writes a record first (:meth:`PooledRecords.sent`, one pipeline with the
request's arguments), the delivery that takes the request marks it taken by its process
(:meth:`take`), the one that hands it to a GPU marks it handed (:meth:`handoff`), and the
request's end deletes it (:meth:`forget`). The reconcile pass (``tasks/pooled_sweep.py``) sends
again a request whose message the broker lost before any worker took it, and one whose taking
process died while it waited for a GPU (at once, not after the Redis broker's visibility
timeout); a record that is gone while the caller still waits means Redis lost the request
with its message, and the caller's ``.get()`` fails explicitly (``tasks/pooled_result.py``).

The taker's identity also settles duplicates: the Redis broker delivers an unacknowledged
message again after its visibility timeout even while the first delivery still waits for a GPU;
such a delivery finds the request taken by a live process and is dropped (:meth:`take`), and a
delivery superseded after its process was judged dead gives its GPU back (:meth:`handoff`).
A process is alive as the wait queue judges it (``store/liveness.py``).

Keys (one deployment prefix; a request's record and its pool's indexes all carry the pool's hash
tag ``{pool:<pool>}``, so each script below is one Cluster slot; ``pooled-pools`` is the hint set
of the pools the sweep goes over):

* ``pooled:<id>``: hash ``data`` (the arguments and queue, JSON), ``state`` (``sent``,
  ``taken``, ``handed``), ``taker`` (process id), ``delivery`` (one run of the task),
  ``attempt``; expires after the record TTL in any case;
* ``pooled-unseen``: sorted set, id -> when it was (last) sent, epoch ms: requests no worker
  has taken yet;
* ``pooled-taken``: sorted set, id -> when it was taken (server ms): requests waiting for a GPU;
* ``pooled-handed``: sorted set, id -> when it was handed to a GPU (server ms);
* ``pooled-missing``: sorted set, id -> when a sweep first found its message missing.
"""

from __future__ import annotations

import json
import threading
from typing import Any, TypeGuard

from ..errors import ConfigError
from .keys import Keys, check_pool
from .liveness import PROCESS_TTL_MS
from .scripts import lua_script
from .timers import as_text, store_errors

RECORD_TTL_S = 86_400.0  # a record outlives any wait it covers; its request's end deletes it

# what :meth:`PooledRecords.take` and :meth:`PooledRecords.handoff` answer
TAKEN, DUPLICATE, HANDED, UNRECORDED, SUPERSEDED = (
    "taken",
    "duplicate",
    "handed",
    "unrecorded",
    "superseded",
)


def record_data(request_id: str, args: Any, kwargs: Any, queue: str | None) -> str:
    """A record's ``data`` field: what sending the request again takes (JSON)."""
    try:
        return json.dumps(
            {"args": list(args), "kwargs": dict(kwargs), "queue": queue}, separators=(",", ":")
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"pooled request {request_id}: not JSON-serialisable ({e})", key="request"
        ) from None


def recordable(pool: Any) -> TypeGuard[str]:
    """Whether a request naming ``pool`` can have a record (its pool's name is safe in a hash
    tag); one that cannot is refused by ``pooled_infer`` with a one-line ConfigError anyway."""
    try:
        check_pool(pool)
    except ValueError:
        return False
    return True


class PooledRecords:
    """The records of pooled requests under one key prefix (see the module docstring): one
    :class:`PoolRecords` per pool, and the hint set of the pools that ever had one."""

    def __init__(self, client: Any, keys: Keys, ttl_s: float = RECORD_TTL_S):
        self.client = client
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)
        self._pools: dict[str, PoolRecords] = {}
        self._lock = threading.Lock()

    def of(self, pool: str) -> PoolRecords:
        """The records of ``pool``'s requests (ValueError for a name unsafe in a hash tag)."""
        with self._lock:
            found = self._pools.get(pool)
            if found is None:
                found = PoolRecords(self.client, self.keys, check_pool(pool), self.ttl_ms)
                self._pools[pool] = found
            return found

    def pools(self) -> list[str]:
        """Every pool that had a pooled request (the sweep looks at each), sorted."""
        with store_errors("listing the pools of pooled requests"):
            found = self.client.smembers(self.keys.pooled_pools())
        return sorted(p for p in (as_text(v) for v in found) if recordable(p))


class PoolRecords:
    """The records of one pool's pooled requests: the records and their indexes all carry the
    pool's hash tag, so each script below (and the pool's queue and leases) is one slot."""

    def __init__(self, client: Any, keys: Keys, pool: str, ttl_ms: int):
        self.client = client
        self.keys = keys
        self.pool = pool
        self.ttl_ms = ttl_ms
        self.unseen_key = keys.pooled_unseen(pool)
        self.taken_key = keys.pooled_taken(pool)
        self.missing_key = keys.pooled_missing(pool)
        self.handed_key = keys.pooled_handed(pool)
        self._noted = False

    def note(self) -> None:
        """Add the pool to the hint set the sweep reads (once per process; its own command,
        on its own slot): before the pool's first record is written."""
        if not self._noted:
            with store_errors(f"noting pool {self.pool!r} for pooled requests"):
                self.client.sadd(self.keys.pooled_pools(), self.pool)
            self._noted = True

    def record_key(self, request_id: str) -> str:
        return self.keys.pooled(self.pool, request_id)

    # -- the caller --------------------------------------------------------------------------
    def sent(
        self, request_id: str, args: Any, kwargs: Any, now_ms: int, queue: str | None = None
    ) -> None:
        """Record a request about to be sent (again): its arguments and queue, so it can be
        sent again (``queue`` None: the app's route); no taker."""
        data = record_data(request_id, args, kwargs, queue)
        key = self.record_key(request_id)
        self.note()
        with store_errors(f"recording pooled request {request_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(key, mapping={"data": data, "state": "sent"})
            pipe.hdel(key, "taker", "delivery", "attempt", "gpu", "token")
            pipe.pexpire(key, self.ttl_ms)
            pipe.zadd(self.unseen_key, {request_id: now_ms})
            pipe.zrem(self.taken_key, request_id)
            pipe.zrem(self.missing_key, request_id)
            pipe.zrem(self.handed_key, request_id)
            pipe.execute()

    def known(self, request_id: str) -> bool:
        """Whether Redis still holds the request's record."""
        with store_errors(f"reading pooled request {request_id!r}"):
            return bool(self.client.exists(self.record_key(request_id)))

    # -- the worker --------------------------------------------------------------------------
    def take(self, request_id: str, process_id: str, delivery: str, attempt: int = 0) -> str:
        """This delivery takes the request: :data:`TAKEN` (or :data:`UNRECORDED`: sent without
        a record) to go on, :data:`DUPLICATE` or :data:`HANDED` to drop it. A higher
        ``attempt`` (sent back to waiting after its GPU was lost) always takes it."""
        keys = [
            self.record_key(request_id),
            self.unseen_key,
            self.taken_key,
            self.missing_key,
            self.keys.procs(self.pool),
            self.handed_key,
        ]
        args = [
            request_id,
            process_id,
            delivery,
            PROCESS_TTL_MS,
            self.keys.proc_channel(),
            int(attempt),
            self.ttl_ms,
        ]
        with store_errors(f"taking pooled request {request_id!r}"):
            return as_text(lua_script(self.client, "pooled_take")(keys=keys, args=args))

    def handoff(self, request_id: str, delivery: str, gpu_id: str = "", token: int = 0) -> str:
        """This delivery hands the request to a GPU: :data:`HANDED` (or :data:`UNRECORDED`) to
        go on, :data:`SUPERSEDED` to give the GPU back and drop it. ``gpu_id`` and ``token``:
        the lease it runs under; should that lease end with the request still handed, the sweep
        sends it again (:meth:`handed_to`)."""
        keys = [self.record_key(request_id), self.taken_key, self.handed_key]
        with store_errors(f"handing pooled request {request_id!r} to a GPU"):
            return as_text(
                lua_script(self.client, "pooled_handoff")(
                    keys=keys, args=[request_id, delivery, self.ttl_ms, gpu_id, int(token)]
                )
            )

    def forget(self, request_id: str) -> None:
        """The request ended (a result or an error is stored): its record goes."""
        with store_errors(f"forgetting pooled request {request_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self.record_key(request_id))
            pipe.zrem(self.unseen_key, request_id)
            pipe.zrem(self.taken_key, request_id)
            pipe.zrem(self.missing_key, request_id)
            pipe.zrem(self.handed_key, request_id)
            pipe.execute()

    # -- the sweep ---------------------------------------------------------------------------
    def untaken_since(self, before_ms: int, limit: int = 500) -> list[str]:
        """Ids of requests sent before ``before_ms`` that no worker has taken yet."""
        with store_errors("listing untaken pooled requests"):
            found = self.client.zrangebyscore(self.unseen_key, "-inf", before_ms, 0, limit)
        return [as_text(i) for i in found]

    def dead_takers(self, min_age_ms: int, limit: int = 500) -> list[tuple[str, str]]:
        """(id, taker) of requests taken at least ``min_age_ms`` ago whose taking process is
        dead: the taker as judged dead, so a live delivery that takes the request meanwhile is
        not sent again over (see :meth:`requeue`)."""
        with store_errors("listing pooled requests of dead processes"):
            seconds, micros = self.client.time()
            now = int(seconds) * 1000 + int(micros) // 1000
            old = self.client.zrangebyscore(self.taken_key, "-inf", now - min_age_ms)
            ids = [as_text(i) for i in old]
            if not ids:
                return []
            keys = [self.taken_key, self.keys.procs(self.pool)]
            keys += [self.record_key(i) for i in ids]
            args = [PROCESS_TTL_MS, self.keys.proc_channel(), limit, *ids]
            found = lua_script(self.client, "pooled_dead_takers")(keys=keys, args=args)
        flat = [as_text(i) for i in found]
        return list(zip(flat[::2], flat[1::2], strict=True))

    def handed_before(self, before_ms: int, limit: int = 500) -> list[str]:
        """Ids of requests handed to a GPU before ``before_ms`` (server ms) and not ended."""
        with store_errors("listing pooled requests handed to GPUs"):
            found = self.client.zrangebyscore(self.handed_key, "-inf", before_ms, 0, limit)
        return [as_text(i) for i in found]

    def handed_to(self, request_id: str) -> tuple[str, int, str] | None:
        """(GPU, lease token, taker) of a request handed to a GPU; None (and its index entry
        dropped) when it ended or is no longer handed."""
        with store_errors(f"reading pooled request {request_id!r}"):
            state, gpu, token, taker = self.client.hmget(
                self.record_key(request_id), "state", "gpu", "token", "taker"
            )
            if state is None or as_text(state) != "handed" or gpu is None:
                self.client.zrem(self.handed_key, request_id)
                return None
        return as_text(gpu), int(token or 0), as_text(taker or "")

    def requeue(
        self, request_id: str, seen_state: str, seen_taker: str, now_ms: int
    ) -> tuple[list[Any], dict[str, Any], str | None] | None:
        """Mark the request sent again (no taker) if it is still in ``seen_state`` with
        ``seen_taker`` ('' for none); its arguments and queue to send, or None when it changed
        meanwhile (taken by a live delivery, handed to a GPU, ended)."""
        keys = [
            self.record_key(request_id),
            self.unseen_key,
            self.taken_key,
            self.missing_key,
            self.handed_key,
        ]
        with store_errors(f"sending pooled request {request_id!r} again"):
            raw = lua_script(self.client, "pooled_requeue")(
                keys=keys, args=[request_id, seen_state, seen_taker, now_ms]
            )
        if not raw:
            return None
        data = json.loads(raw)
        return list(data["args"]), dict(data["kwargs"]), data.get("queue")

    def taker(self, request_id: str) -> str:
        """The process id of the request's taker ('' for none)."""
        with store_errors(f"reading pooled request {request_id!r}"):
            found = self.client.hget(self.record_key(request_id), "taker")
        return "" if found is None else as_text(found)

    def arguments(self, request_id: str) -> tuple[list[Any], dict[str, Any], str | None] | None:
        """The request's arguments and queue, or None when its record is gone."""
        with store_errors(f"reading pooled request {request_id!r}"):
            raw = self.client.hget(self.record_key(request_id), "data")
        if raw is None:
            return None
        data = json.loads(raw)
        return list(data["args"]), dict(data["kwargs"]), data.get("queue")

    def state(self, request_id: str) -> str | None:
        """``sent``, ``taken`` or ``handed``; None when the record is gone."""
        with store_errors(f"reading pooled request {request_id!r}"):
            found = self.client.hget(self.record_key(request_id), "state")
        return None if found is None else as_text(found)

    def missing_since(self, request_id: str, now_ms: int) -> int:
        """When a sweep first found this request's message missing (``now_ms`` if this is
        the first time: recorded)."""
        with store_errors(f"noting pooled request {request_id!r} missing"):
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(self.missing_key, {request_id: now_ms}, nx=True)
            pipe.zscore(self.missing_key, request_id)
            return int(float(pipe.execute()[1]))

    def found(self, request_id: str) -> None:
        """Its message is in the broker after all: no longer counted as missing."""
        with store_errors(f"noting pooled request {request_id!r} found"):
            self.client.zrem(self.missing_key, request_id)

    def drop(self, request_id: str) -> None:
        """Forget an untaken-index entry whose record expired or was taken meanwhile."""
        with store_errors(f"dropping pooled request {request_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(self.unseen_key, request_id)
            pipe.zrem(self.missing_key, request_id)
            pipe.execute()
