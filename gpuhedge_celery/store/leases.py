"""The GPU lease table in Redis: registry, claims with fencing tokens, renew, release, reconcile.

A lease is the string key ``<prefix>:lease:<gpu>`` = ``token|since_ms|holder`` with a PX TTL,
created by one Lua script that also issues the GPU's next fencing token, the larger of its INCR'd
counter and Redis's clock in ms x 1000 (``lua/_token.lua``), so tokens strictly increase per GPU,
across a failover that lost the counter's last writes too. Release and renew compare the token
and the holder inside Lua; a holder whose lease is gone or was taken over gets
:class:`~gpuhedge_celery.errors.LeaseLost`, never a silent success. The worker-side fence check
also keeps this process's own mark per GPU (:class:`~gpuhedge_celery.core.lease_rules.FenceMark`).

Deviations from / additions to the agreed API (for the Celery-glue engineer):

* ``Lease`` has one extra field, ``since_ms`` (epoch ms when the lease was claimed), default 0.
* ``try_claim`` of an unregistered GPU raises ``ConfigError`` (key ``gpu_id``).
* ``set_pool_ttl`` / ``host_heartbeat`` / ``try_claim`` with ``ttl_ms <= 0`` raise ``ConfigError``.
* ``pool_ttl`` of a pool whose TTL was never set returns ``DEFAULT_POOL_TTL_MS`` (60 s).
* ``restore(..., since_ms=None)`` takes an optional keyword for the job's start (epoch ms); it
  returns False when another token holds the lease or the token is older than one accepted.
* ``current()`` reports the pool's TTL as ``ttl_ms`` (the granted TTL is not stored).
* Extras: ``unregister_gpu``, ``host_live``, ``accepted_token``, ``last_token``,
  ``record_duration(pool, seconds)`` / ``durations(pool)`` (runners record job lengths here;
  ``gpuhedge-celery leases suggest-ttl --pool P`` reads them), ``queue(pool)`` (waiting holders
  in FIFO order), ``live_gpus(pool)``.
* ``LeaseKeeper`` lives in ``store/keeper.py``; ``GpuInfo``, ``Lease`` and ``LeaseRow`` are plain
  data in ``core/lease_rules.py``. All are re-exported here.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, overload

from ..core.lease_rules import (
    DEFAULT_POOL_TTL_MS,
    FenceMark,
    GpuInfo,
    Lease,
    LeaseRow,
    classify,
    parse_lease_value,
    parse_out,
    validate_ttl_ms,
)
from ..errors import ConfigError, EmptyPool, StaleToken, UnknownPool
from .connection import client_for, client_location, translate_errors
from .keeper import LeaseKeeper
from .keys import Keys
from .scripts import OK, UNKNOWN_GPU, raise_for_code, scripts_for

if TYPE_CHECKING:
    import redis

    from ..settings import Settings

__all__ = ["GpuInfo", "Lease", "LeaseKeeper", "LeaseRow", "LeaseStore"]

log = logging.getLogger(__name__)

DURATIONS_KEPT = 1000


def now_ms() -> int:
    """Epoch milliseconds (the "now" passed to scripts for ``since`` and waiter liveness)."""
    return int(time.time() * 1000)


@overload
def _text(value: None) -> None: ...
@overload
def _text(value: str | bytes | int | float) -> str: ...
def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _json_or_none(value: Any) -> Any:
    try:
        return None if value is None else json.loads(_text(value))
    except ValueError:
        return None


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ConfigError(f"expected a non-empty name without spaces, got {value!r}", key=what)
    return value


def _ttl(ttl_ms: Any, what: str) -> int:
    try:
        return validate_ttl_ms(ttl_ms, what="the TTL")
    except ValueError as e:
        raise ConfigError(str(e), key=what) from None


class LeaseStore:
    """The lease table of one deployment (one Redis, one key prefix)."""

    def __init__(self, client: redis.Redis, prefix: str = "gpuhedge"):
        self.client = client
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.scripts = scripts_for(client)
        self.where = client_location(client)  # never holds the password
        # The highest token this process accepted per GPU: what Redis's accepted key says,
        # kept here too because a failover can lose that key.
        self._marks: dict[str, FenceMark] = {}
        self._marks_lock = threading.Lock()
        # One per GPU: check_mark, the Redis check and record_mark run as one step per GPU.
        self._gates: dict[str, threading.Lock] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> LeaseStore:
        """The store for ``settings`` on this process's shared client."""
        return cls(client_for(settings.redis_url), prefix=settings.prefix)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Translate driver connection errors into StoreUnavailable (one clear line)."""
        with translate_errors(self.where):
            yield

    # -- registry ---------------------------------------------------------------------------
    def register_gpu(self, info: GpuInfo) -> None:
        """Add (or move) a GPU into the registry under its pool and host."""
        _check_name(info.gpu_id, "gpu_id")
        _check_name(info.pool, "pool")
        _check_name(info.host, "host")
        k = self.keys
        with self.guard():
            old = self.client.hmget(k.gpu(info.gpu_id), "pool", "host")
            pipe = self.client.pipeline()
            if old[0] and _text(old[0]) != info.pool:
                pipe.srem(k.pool_gpus(_text(old[0])), info.gpu_id)
            if old[1] and _text(old[1]) != info.host:
                pipe.srem(k.host_gpus(_text(old[1])), info.gpu_id)
            pipe.hset(
                k.gpu(info.gpu_id),
                mapping={
                    "pool": info.pool,
                    "host": info.host,
                    "labels": json.dumps(info.labels, sort_keys=True),
                },
            )
            pipe.sadd(k.all_gpus(), info.gpu_id)
            pipe.sadd(k.pool_gpus(info.pool), info.gpu_id)
            pipe.sadd(k.pools(), info.pool)
            pipe.sadd(k.host_gpus(info.host), info.gpu_id)
            pipe.execute()

    def unregister_gpu(self, gpu_id: str) -> bool:
        """Remove a GPU from the registry (its lease, if any, is left to expire)."""
        k = self.keys
        with self.guard():
            pool, host = (_text(v) for v in self.client.hmget(k.gpu(gpu_id), "pool", "host"))
            if pool is None:
                return False
            pipe = self.client.pipeline()
            pipe.srem(k.pool_gpus(pool), gpu_id)
            pipe.srem(k.host_gpus(host or ""), gpu_id)
            pipe.srem(k.all_gpus(), gpu_id)
            pipe.delete(k.gpu(gpu_id))
            pipe.execute()
            return True

    def set_pool_ttl(self, pool: str, ttl_ms: int) -> None:
        """Set the lease TTL of a pool; ``ttl_ms <= 0`` raises ConfigError."""
        _check_name(pool, "pool")
        ttl = _ttl(ttl_ms, f"pools.{pool}.ttl_ms")
        with self.guard():
            self.client.hset(self.keys.pool_ttl(), pool, ttl)

    def pool_ttl(self, pool: str) -> int:
        """The pool's lease TTL in ms (DEFAULT_POOL_TTL_MS until one is set)."""
        with self.guard():
            value = self.client.hget(self.keys.pool_ttl(), pool)
        return int(value) if value is not None else DEFAULT_POOL_TTL_MS

    def host_heartbeat(self, host: str, ttl_ms: int) -> None:
        """Mark ``host`` alive for ``ttl_ms``; a host that stops calling this leaves the pool."""
        _check_name(host, "host")
        ttl = _ttl(ttl_ms, "host_heartbeat.ttl_ms")
        with self.guard():
            self.client.set(self.keys.host(host), now_ms(), px=ttl)

    def host_live(self, host: str) -> bool:
        """Whether ``host`` heartbeated within its last heartbeat TTL."""
        with self.guard():
            return bool(self.client.exists(self.keys.host(host)))

    def pools(self) -> list[str]:
        """Every pool with at least one registered GPU, sorted."""
        with self.guard():
            return sorted(_text(p) for p in self.client.smembers(self.keys.pools()))

    def gpus(self, pool: str | None = None, *, live_only: bool = True) -> list[GpuInfo]:
        """Registered GPUs (of one pool, or all), sorted by id; by default only live hosts'."""
        k = self.keys
        with self.guard():
            members = self.client.smembers(k.pool_gpus(pool) if pool else k.all_gpus())
            ids = sorted(_text(m) for m in members)
            pipe = self.client.pipeline(transaction=False)
            for gpu_id in ids:
                pipe.hgetall(k.gpu(gpu_id))
            found: list[GpuInfo] = []
            for gpu_id, data in zip(ids, pipe.execute(), strict=True):
                data = {_text(a): _text(b) for a, b in data.items()}
                if "pool" in data and (pool is None or data["pool"] == pool):
                    labels = json.loads(data.get("labels") or "{}")
                    found.append(GpuInfo(gpu_id, data["pool"], data.get("host", ""), labels))
            if not live_only or not found:
                return found
            hosts = sorted({g.host for g in found})
            live = dict(zip(hosts, self._live(hosts), strict=True))
            return [g for g in found if live[g.host]]

    def _live(self, hosts: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for host in hosts:
            pipe.exists(self.keys.host(host))
        return [bool(x) for x in pipe.execute()]

    def live_gpus(self, pool: str, labels: dict[str, str] | None = None) -> list[GpuInfo]:
        """The pool's GPUs on live hosts matching ``labels``; UnknownPool / EmptyPool if none."""
        every = self.gpus(pool, live_only=False)
        if not every:
            raise UnknownPool(pool)
        live = self.gpus(pool, live_only=True)
        if not live:
            raise EmptyPool(pool)
        if labels:
            live = [g for g in live if all(g.labels.get(a) == b for a, b in labels.items())]
            if not live:
                wanted = ", ".join(f"{a}={b}" for a, b in sorted(labels.items()))
                raise EmptyPool(pool) from ConfigError(f"no live GPU has labels {wanted}")
        return live

    # -- leases -----------------------------------------------------------------------------
    def try_claim(self, gpu_id: str, holder: str, ttl_ms: int | None = None) -> Lease | None:
        """Claim ``gpu_id`` for ``holder`` if it is free: the lease, or None when it is held or out
        of the pool (drained, unhealthy, its model not loaded)."""
        _check_name(holder, "holder")
        ttl = 0 if ttl_ms is None else _ttl(ttl_ms, "ttl_ms")
        k = self.keys
        since = now_ms()
        with self.guard():
            reply = self.scripts.claim(
                keys=[k.lease(gpu_id), k.fence(gpu_id), k.gpu(gpu_id), k.pool_ttl(), k.out(gpu_id)],
                args=[holder, ttl, since, DEFAULT_POOL_TTL_MS],
            )
        code = int(reply[0])
        if code == UNKNOWN_GPU:
            raise ConfigError(f"GPU {gpu_id!r} is not registered", key="gpu_id")
        if code != OK:  # BUSY (held) or OUT_OF_POOL
            return None
        return Lease(gpu_id, _text(reply[3]), int(reply[1]), holder, int(reply[2]), since)

    def renew(self, lease: Lease, ttl_ms: int | None = None) -> Lease:
        """Extend ``lease`` (to ``ttl_ms`` or its own TTL); LeaseLost if it is no longer held."""
        ttl = lease.ttl_ms if ttl_ms is None else _ttl(ttl_ms, "ttl_ms")
        with self.guard():
            code = self.scripts.renew(
                keys=[self.keys.lease(lease.gpu_id)], args=[lease.token, ttl, lease.holder]
            )
        raise_for_code(int(code), lease.gpu_id, lease.token)
        return replace(lease, ttl_ms=ttl)

    def release(self, lease: Lease) -> None:
        """Free ``lease``'s GPU; LeaseLost if the lease expired or another holder has it."""
        with self.guard():
            code = self.scripts.release(
                keys=[self.keys.lease(lease.gpu_id)], args=[lease.token, lease.holder]
            )
        raise_for_code(int(code), lease.gpu_id, lease.token)

    def current(self, gpu_id: str) -> Lease | None:
        """The lease now held on ``gpu_id`` (``ttl_ms`` is the pool's TTL), or None."""
        k = self.keys
        with self.guard():
            value, pool = self.client.get(k.lease(gpu_id)), self.client.hget(k.gpu(gpu_id), "pool")
            if value is None:
                return None
            pool = _text(pool) or ""
            ttl = self.pool_ttl(pool) if pool else DEFAULT_POOL_TTL_MS
        token, since, holder = parse_lease_value(_text(value))
        return Lease(gpu_id, pool, token, holder, ttl, since)

    def check_fence(self, gpu_id: str, token: int, delivery: str = "", holder: str = "") -> None:
        """Worker-side gate: StaleToken if a newer token was accepted (in Redis, or by this
        process: :meth:`check_mark`), LeaseLost if not current (or, given ``holder``, current
        for another holder). ``delivery`` names the work, so the same work may check again."""
        token = int(token)
        k = self.keys
        with self.fence_gate(gpu_id):
            self.check_mark(gpu_id, token, delivery)
            with self.guard():
                code, current = self.scripts.check_fence(
                    keys=[k.lease(gpu_id), k.accepted(gpu_id)], args=[token, "", holder]
                )
            raise_for_code(int(code), gpu_id, token, int(current))
            self.record_mark(gpu_id, token, delivery, holder)

    @contextmanager
    def fence_gate(self, gpu_id: str) -> Iterator[None]:
        """Hold the GPU's gate lock: two deliveries checking at once cannot both pass
        check_mark before either records its mark. Per GPU, so GPUs never wait on each other."""
        with self._marks_lock:
            gate = self._gates.setdefault(gpu_id, threading.Lock())
        with gate:
            yield

    def check_mark(self, gpu_id: str, token: int, delivery: str = "") -> None:
        """StaleToken if this process accepted a newer token for the GPU, or this one for
        another delivery (before any Redis step: the refused work never starts). Call it, the
        Redis check and :meth:`record_mark` under :meth:`fence_gate`."""
        with self._marks_lock:
            mark = self._marks.get(gpu_id, FenceMark())
        if mark.refuses(token, delivery):
            raise StaleToken(gpu_id, token, mark.token)

    def record_mark(self, gpu_id: str, token: int, delivery: str = "", holder: str = "") -> None:
        """Remember that this process accepted ``token`` for ``delivery`` (of ``holder``)."""
        with self._marks_lock:
            mark = self._marks.get(gpu_id, FenceMark())
            self._marks[gpu_id] = mark.after(token, delivery, holder)

    def unblock(self, gpu_id: str, token: int, holder: str = "") -> bool:
        """After :meth:`check_mark` refused ``token`` (of ``holder``): free its lease unless work
        this process accepted runs under it, and lift the GPU's fence counter to the mark, so
        the next claim issues a token this process takes. True if a lease was freed.

        Without it the refused lease holds the GPU idle until its TTL lapses, and after a
        failover to a primary whose clock is behind every new token would be refused too.
        """
        token = int(token)
        with self._marks_lock:
            mark = self._marks.get(gpu_id, FenceMark())
        if not mark.frees(token, holder):
            return False
        k = self.keys
        free_holder = holder if token == mark.token else ""  # below the mark: any holder's
        with self.guard():
            freed, counter = self.scripts.fence_lift(
                keys=[k.lease(gpu_id), k.fence(gpu_id)], args=[token, free_holder, mark.token]
            )
        log.warning(
            "GPU %s refused token %d (its mark: token %d): %s, fence counter now %s",
            gpu_id,
            token,
            mark.token,
            "its lease freed" if int(freed) else "no lease of it left to free",
            _text(counter),
        )
        return int(freed) == 1

    def mark(self, gpu_id: str) -> int:
        """The highest token this process accepted for the GPU (0 if none)."""
        with self._marks_lock:
            return self._marks.get(gpu_id, FenceMark()).token

    def accepted_token(self, gpu_id: str) -> int:
        """The highest token the GPU's worker has accepted through check_fence (0 if none)."""
        with self.guard():
            return int(self.client.get(self.keys.accepted(gpu_id)) or 0)

    def last_token(self, gpu_id: str) -> int:
        """The last fencing token issued for the GPU (0 if none)."""
        with self.guard():
            return int(self.client.get(self.keys.fence(gpu_id)) or 0)

    def force_release(self, gpu_id: str, token: int | None = None) -> bool:
        """Reconcile: free the GPU's lease (only if it carries ``token``, when given)."""
        arg = "" if token is None else int(token)
        with self.guard():
            return int(self.scripts.force_release(keys=[self.keys.lease(gpu_id)], args=[arg])) == 1

    def restore(
        self,
        gpu_id: str,
        holder: str,
        token: int,
        ttl_ms: int | None = None,
        *,
        since_ms: int | None = None,
    ) -> bool:
        """Reconcile: re-create the lease of a job the worker reports running, keeping its token.

        True when the lease now exists with ``token``; False when another token holds it or the
        GPU already accepted a newer token.
        """
        _check_name(holder, "holder")
        k = self.keys
        with self.guard():
            if ttl_ms is None:
                pool = _text(self.client.hget(k.gpu(gpu_id), "pool"))
                ttl = self.pool_ttl(pool) if pool else DEFAULT_POOL_TTL_MS
            else:
                ttl = _ttl(ttl_ms, "ttl_ms")
            code = self.scripts.restore(
                keys=[k.lease(gpu_id), k.fence(gpu_id), k.accepted(gpu_id)],
                args=[holder, int(token), ttl, since_ms or now_ms()],
            )
        return int(code) == OK

    def table(self, pool: str | None = None) -> list[LeaseRow]:
        """One row per registered GPU (of ``pool``, or all): state, holder, token, TTL left, why
        it is out of the pool (if it is) and its worker's last health sample."""
        gpus = self.gpus(pool, live_only=False)
        if pool is not None and not gpus:
            raise UnknownPool(pool)
        k = self.keys
        with self.guard():
            hosts = sorted({g.host for g in gpus})
            live = dict(zip(hosts, self._live(hosts), strict=True))
            pipe = self.client.pipeline(transaction=False)
            for g in gpus:
                pipe.get(k.lease(g.gpu_id))
                pipe.pttl(k.lease(g.gpu_id))
                pipe.get(k.accepted(g.gpu_id))
                pipe.hgetall(k.out(g.gpu_id))
                pipe.get(k.health(g.gpu_id))
            replies = pipe.execute()
        rows = []
        for i, g in enumerate(gpus):
            value, pttl, accepted, out, health = replies[5 * i : 5 * i + 5]
            accepted = int(accepted or 0)
            token = since = ttl_left = holder = None
            if value is not None:
                token, since, holder = parse_lease_value(_text(value))
                ttl_left = int(pttl) if int(pttl) >= 0 else None
            state = classify(
                leased=value is not None,
                host_live=live[g.host],
                token=token or 0,
                accepted=accepted,
            )
            rows.append(
                LeaseRow(
                    g.gpu_id,
                    g.pool,
                    g.host,
                    live[g.host],
                    state,
                    holder,
                    token,
                    ttl_left,
                    since,
                    accepted,
                    g.labels,
                    parse_out({_text(a): _text(b) for a, b in out.items()}),
                    _json_or_none(health),
                )
            )
        return rows

    # -- job durations (for TTL suggestions) and the wait queue ---------------------------------
    def record_duration(self, pool: str, seconds: float) -> None:
        """Remember one job's run time in ``pool`` (the newest 1,000 are kept)."""
        if not seconds >= 0:
            raise ConfigError(f"expected a duration >= 0 s, got {seconds!r}", key="duration")
        key = self.keys.durations(pool)
        with self.guard():
            pipe = self.client.pipeline()
            pipe.lpush(key, f"{float(seconds):.6f}")
            pipe.ltrim(key, 0, DURATIONS_KEPT - 1)
            pipe.execute()

    def durations(self, pool: str) -> list[float]:
        """Recorded job durations of ``pool`` in seconds, newest first."""
        with self.guard():
            return [float(v) for v in self.client.lrange(self.keys.durations(pool), 0, -1)]

    def queue(self, pool: str) -> list[str]:
        """Holders waiting for a GPU of ``pool``, longest waiter first."""
        with self.guard():
            return [_text(h) for h in self.client.zrange(self.keys.waiters(pool), 0, -1)]
