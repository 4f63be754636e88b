"""The GPU lease table in Redis: registry, claims with fencing tokens, renew, release, reconcile.

Every key of a pool and of its GPUs carries the pool's Redis Cluster hash tag (``{pool:<name>}``,
:mod:`.keys`), so each script touches one slot; the registry hash ``gpu-pools`` (gpu -> pool,
read once per process and GPU) tells an API given a GPU id which pool's keys to use.
A lease is the string key ``<prefix>:{pool:<pool>}:lease:<gpu>`` = ``token|since_ms|holder`` with a
PX TTL, created by one Lua script that also issues the GPU's next fencing token, the larger of its
INCR'd counter and Redis's clock in ms x 1000 (``lua/_token.lua``), so tokens strictly increase per
GPU, across a failover that lost the counter's last writes too. Release and renew compare the token
and the holder inside Lua; a holder whose lease is gone or was taken over gets
:class:`~gpuhedge_celery.errors.LeaseLost`, never a silent success. The worker-side fence check also
keeps this process's own mark per GPU (:class:`~gpuhedge_celery.core.lease_rules.FenceMark`).

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
from .keys import Keys, check_pool
from .scripts import OK, UNKNOWN_GPU, raise_for_code, scripts_for

if TYPE_CHECKING:
    import redis

    from ..settings import Settings

__all__ = ["GpuInfo", "Lease", "LeaseKeeper", "LeaseRow", "LeaseStore"]

log = logging.getLogger(__name__)

DURATIONS_KEPT = 1000
# How long a process trusts the GPU -> pool registry it read (a GPU moved to another pool is
# found at once by a claim, whose script checks the pool's registry hash, and by others after).
POOL_CACHE_S = 10.0


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


def _check_pool(pool: str) -> str:
    try:
        return check_pool(pool)
    except ValueError as e:
        raise ConfigError(str(e), key="pool") from None


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
        # gpu id -> pool, as the registry said (every key of a GPU carries its pool's tag)
        self._pools: dict[str, tuple[float, str]] = {}  # gpu id -> (read at, pool)
        self._expected: dict[str, str] = {}  # gpu id -> pool, for this process's own GPU

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
    def pool_of(self, gpu_id: str) -> str:
        """The pool ``gpu_id`` is registered in (cached per process for ``POOL_CACHE_S``: every
        key of the GPU carries its pool's hash tag); ConfigError if it is not registered."""
        pool = self.pool_or_none(gpu_id)
        if pool is None:
            raise ConfigError(f"GPU {gpu_id!r} is not registered", key="gpu_id")
        return pool

    def pool_or_none(self, gpu_id: str) -> str | None:
        now = time.monotonic()
        with self._marks_lock:
            own, cached = self._expected.get(gpu_id), self._pools.get(gpu_id)
        if own is not None:  # this process's own GPU: its configuration, which it registers
            return own
        if cached is not None and now - cached[0] < POOL_CACHE_S:
            return cached[1]
        with self.guard():
            found = self.client.hget(self.keys.gpu_pools(), gpu_id)
        pool: str | None = None if found is None else str(_text(found))
        with self._marks_lock:
            if pool is None:
                self._pools.pop(gpu_id, None)
                return None
            self._pools[gpu_id] = (now, pool)
        return pool

    def expect(self, gpu_id: str, pool: str) -> None:
        """This process serves ``gpu_id`` in ``pool`` (its worker's configuration): its keys are
        found there whatever the registry says (a worker's child marks the GPU out of the pool
        while its model loads, before the main process registered it, and a GPU moved from
        another pool is still registered there until then)."""
        with self._marks_lock:
            self._expected[gpu_id] = check_pool(pool)

    def _forget_pool(self, gpu_id: str) -> None:
        with self._marks_lock:
            self._pools.pop(gpu_id, None)

    def register_gpu(self, info: GpuInfo) -> None:
        """Add (or move) a GPU into the registry under its pool and host."""
        _check_name(info.gpu_id, "gpu_id")
        _check_pool(info.pool)
        _check_name(info.host, "host")
        k = self.keys
        with self.guard():
            self._forget_pool(info.gpu_id)
            old_pool = self.pool_or_none(info.gpu_id)
            old_host = None
            if old_pool is not None:
                old_host = _text(self.client.hget(k.gpu(old_pool, info.gpu_id), "host"))
                if old_pool != info.pool:
                    pipe = self.client.pipeline()
                    pipe.srem(k.pool_gpus(old_pool), info.gpu_id)
                    pipe.delete(k.gpu(old_pool, info.gpu_id))
                    pipe.execute()
            pipe = self.client.pipeline()
            pipe.hset(
                k.gpu(info.pool, info.gpu_id),
                mapping={
                    "pool": info.pool,
                    "host": info.host,
                    "labels": json.dumps(info.labels, sort_keys=True),
                },
            )
            pipe.sadd(k.pool_gpus(info.pool), info.gpu_id)
            pipe.execute()
            # The hints, each its own command (each on its own slot in a cluster).
            self.client.hset(k.gpu_pools(), info.gpu_id, info.pool)
            self.client.sadd(k.pools(), info.pool)
            if old_host is not None and old_host != info.host:
                self.client.srem(k.host_gpus(old_host), info.gpu_id)
            self.client.sadd(k.host_gpus(info.host), info.gpu_id)
            self.client.sadd(k.host_pools(info.host), info.pool)
            self._carry_heartbeat(info.host, info.pool)
        with self._marks_lock:
            self._pools[info.gpu_id] = (time.monotonic(), info.pool)

    def _carry_heartbeat(self, host: str, pool: str) -> None:
        """A live host joining ``pool`` is live there too, until its heartbeat's end elsewhere
        (its heartbeats reach each of its pools from now on)."""
        k = self.keys
        if self.client.exists(k.pool_host(pool, host)):
            return
        for other in sorted(_text(p) for p in self.client.smembers(k.host_pools(host))):
            pipe = self.client.pipeline(transaction=False)
            pipe.get(k.pool_host(other, host))
            pipe.pttl(k.pool_host(other, host))
            value, pttl = pipe.execute()
            if value is not None and int(pttl) > 0:
                self.client.set(k.pool_host(pool, host), value, px=int(pttl), nx=True)
                return

    def unregister_gpu(self, gpu_id: str) -> bool:
        """Remove a GPU from the registry (its lease, if any, is left to expire)."""
        k = self.keys
        pool = self.pool_or_none(gpu_id)
        if pool is None:
            return False
        with self.guard():
            host = _text(self.client.hget(k.gpu(pool, gpu_id), "host"))
            pipe = self.client.pipeline()
            pipe.srem(k.pool_gpus(pool), gpu_id)
            pipe.delete(k.gpu(pool, gpu_id))
            pipe.execute()
            self.client.srem(k.host_gpus(host or ""), gpu_id)
            self.client.hdel(k.gpu_pools(), gpu_id)
        self._forget_pool(gpu_id)
        return True

    def set_pool_ttl(self, pool: str, ttl_ms: int) -> None:
        """Set the lease TTL of a pool; ``ttl_ms <= 0`` raises ConfigError."""
        _check_pool(pool)
        ttl = _ttl(ttl_ms, f"pools.{pool}.ttl_ms")
        with self.guard():
            self.client.set(self.keys.pool_ttl(pool), ttl)

    def pool_ttl(self, pool: str) -> int:
        """The pool's lease TTL in ms (DEFAULT_POOL_TTL_MS until one is set)."""
        _check_pool(pool)
        with self.guard():
            value = self.client.get(self.keys.pool_ttl(pool))
        return int(value) if value is not None else DEFAULT_POOL_TTL_MS

    def host_heartbeat(self, host: str, ttl_ms: int) -> None:
        """Mark ``host`` alive for ``ttl_ms`` in every pool it has GPUs in (register them
        first); a host that stops calling this leaves those pools."""
        _check_name(host, "host")
        ttl = _ttl(ttl_ms, "host_heartbeat.ttl_ms")
        k = self.keys
        now = now_ms()
        with self.guard():
            for pool in sorted(_text(p) for p in self.client.smembers(k.host_pools(host))):
                self.client.set(k.pool_host(pool, host), now, px=ttl)

    def host_leave(self, host: str) -> None:
        """Drop ``host``'s heartbeat at once: its GPUs leave their pools now."""
        k = self.keys
        with self.guard():
            for pool in sorted(_text(p) for p in self.client.smembers(k.host_pools(host))):
                self.client.delete(k.pool_host(pool, host))

    def host_live(self, host: str) -> bool:
        """Whether ``host`` heartbeated within its last heartbeat TTL."""
        k = self.keys
        with self.guard():
            pools = sorted(_text(p) for p in self.client.smembers(k.host_pools(host)))
            return any(self.client.exists(k.pool_host(p, host)) for p in pools)

    def pools(self) -> list[str]:
        """Every pool with at least one registered GPU, sorted."""
        with self.guard():
            return sorted(_text(p) for p in self.client.smembers(self.keys.pools()))

    def gpus(self, pool: str | None = None, *, live_only: bool = True) -> list[GpuInfo]:
        """Registered GPUs (of one pool, or all), sorted by id; by default only live hosts'."""
        if pool is None:
            found = [g for p in self.pools() for g in self.gpus(p, live_only=live_only)]
            return sorted(found, key=lambda g: g.gpu_id)
        _check_pool(pool)
        k = self.keys
        with self.guard():
            ids = sorted(_text(m) for m in self.client.smembers(k.pool_gpus(pool)))
            pipe = self.client.pipeline(transaction=False)
            for gpu_id in ids:
                pipe.hgetall(k.gpu(pool, gpu_id))
            found = []
            for gpu_id, data in zip(ids, pipe.execute(), strict=True):
                data = {_text(a): _text(b) for a, b in data.items()}
                if data.get("pool") == pool:
                    labels = json.loads(data.get("labels") or "{}")
                    found.append(GpuInfo(gpu_id, pool, data.get("host", ""), labels))
            if not live_only or not found:
                return found
            live = self._live(pool, sorted({g.host for g in found}))
            return [g for g in found if live[g.host]]

    def _live(self, pool: str, hosts: list[str]) -> dict[str, bool]:
        pipe = self.client.pipeline(transaction=False)
        for host in hosts:
            pipe.exists(self.keys.pool_host(pool, host))
        return {h: bool(x) for h, x in zip(hosts, pipe.execute(), strict=True)}

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
        for fresh in (False, True):
            if fresh:  # the GPU moved to another pool since this process cached its pool
                self._forget_pool(gpu_id)
            pool = self.pool_of(gpu_id)
            with self.guard():
                reply = self.scripts.claim(
                    keys=[
                        k.lease(pool, gpu_id),
                        k.fence(pool, gpu_id),
                        k.gpu(pool, gpu_id),
                        k.pool_ttl(pool),
                        k.out(pool, gpu_id),
                    ],
                    args=[holder, ttl, since, DEFAULT_POOL_TTL_MS],
                )
            code = int(reply[0])
            if code != UNKNOWN_GPU:
                break
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
                keys=[self._lease_key(lease)], args=[lease.token, ttl, lease.holder]
            )
        raise_for_code(int(code), lease.gpu_id, lease.token)
        return replace(lease, ttl_ms=ttl)

    def release(self, lease: Lease) -> None:
        """Free ``lease``'s GPU; LeaseLost if the lease expired or another holder has it."""
        with self.guard():
            code = self.scripts.release(
                keys=[self._lease_key(lease)], args=[lease.token, lease.holder]
            )
        raise_for_code(int(code), lease.gpu_id, lease.token)

    def _lease_key(self, lease: Lease) -> str:
        """The lease key of ``lease`` (its pool as claimed, else the GPU's registered pool)."""
        return self.keys.lease(lease.pool or self.pool_of(lease.gpu_id), lease.gpu_id)

    def current(self, gpu_id: str) -> Lease | None:
        """The lease now held on ``gpu_id`` (``ttl_ms`` is the pool's TTL), or None."""
        pool = self.pool_or_none(gpu_id)
        if pool is None:
            return None
        with self.guard():
            value = self.client.get(self.keys.lease(pool, gpu_id))
            if value is None:
                return None
            ttl = self.pool_ttl(pool)
        token, since, holder = parse_lease_value(_text(value))
        return Lease(gpu_id, pool, token, holder, ttl, since)

    def check_fence(self, gpu_id: str, token: int, delivery: str = "", holder: str = "") -> None:
        """Worker-side gate: StaleToken if a newer token was accepted (in Redis, or by this
        process: :meth:`check_mark`), LeaseLost if not current (or, given ``holder``, current
        for another holder). ``delivery`` names the work, so the same work may check again."""
        token = int(token)
        k = self.keys
        pool = self.pool_of(gpu_id)
        with self.fence_gate(gpu_id):
            self.check_mark(gpu_id, token, delivery)
            with self.guard():
                code, current = self.scripts.check_fence(
                    keys=[k.lease(pool, gpu_id), k.accepted(pool, gpu_id)],
                    args=[token, "", holder],
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
        pool = self.pool_of(gpu_id)
        free_holder = holder if token == mark.token else ""  # below the mark: any holder's
        with self.guard():
            freed, counter = self.scripts.fence_lift(
                keys=[k.lease(pool, gpu_id), k.fence(pool, gpu_id)],
                args=[token, free_holder, mark.token],
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
        pool = self.pool_or_none(gpu_id)
        if pool is None:
            return 0
        with self.guard():
            return int(self.client.get(self.keys.accepted(pool, gpu_id)) or 0)

    def last_token(self, gpu_id: str) -> int:
        """The last fencing token issued for the GPU (0 if none)."""
        pool = self.pool_or_none(gpu_id)
        if pool is None:
            return 0
        with self.guard():
            return int(self.client.get(self.keys.fence(pool, gpu_id)) or 0)

    def force_release(self, gpu_id: str, token: int | None = None) -> bool:
        """Reconcile: free the GPU's lease (only if it carries ``token``, when given)."""
        arg = "" if token is None else int(token)
        pool = self.pool_or_none(gpu_id)
        if pool is None:
            return False
        with self.guard():
            key = self.keys.lease(pool, gpu_id)
            return int(self.scripts.force_release(keys=[key], args=[arg])) == 1

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
        pool = self.pool_of(gpu_id)
        ttl = self.pool_ttl(pool) if ttl_ms is None else _ttl(ttl_ms, "ttl_ms")
        with self.guard():
            code = self.scripts.restore(
                keys=[k.lease(pool, gpu_id), k.fence(pool, gpu_id), k.accepted(pool, gpu_id)],
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
        replies: dict[str, list[Any]] = {}
        live: dict[tuple[str, str], bool] = {}
        with self.guard():
            for p in sorted({g.pool for g in gpus}):  # one pipeline per pool: one slot each
                mine = [g for g in gpus if g.pool == p]
                hosts = sorted({g.host for g in mine})
                live.update(((p, h), up) for h, up in self._live(p, hosts).items())
                pipe = self.client.pipeline(transaction=False)
                for g in mine:
                    pipe.get(k.lease(p, g.gpu_id))
                    pipe.pttl(k.lease(p, g.gpu_id))
                    pipe.get(k.accepted(p, g.gpu_id))
                    pipe.hgetall(k.out(p, g.gpu_id))
                    pipe.get(k.health(p, g.gpu_id))
                got = pipe.execute()
                for i, g in enumerate(mine):
                    replies[g.gpu_id] = got[5 * i : 5 * i + 5]
        rows = []
        for g in gpus:
            value, pttl, accepted, out, health = replies[g.gpu_id]
            accepted = int(accepted or 0)
            token = since = ttl_left = holder = None
            if value is not None:
                token, since, holder = parse_lease_value(_text(value))
                ttl_left = int(pttl) if int(pttl) >= 0 else None
            state = classify(
                leased=value is not None,
                host_live=live[(g.pool, g.host)],
                token=token or 0,
                accepted=accepted,
            )
            rows.append(
                LeaseRow(
                    g.gpu_id,
                    g.pool,
                    g.host,
                    live[(g.pool, g.host)],
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
        key = self.keys.durations(_check_pool(pool))
        with self.guard():
            pipe = self.client.pipeline()
            pipe.lpush(key, f"{float(seconds):.6f}")
            pipe.ltrim(key, 0, DURATIONS_KEPT - 1)
            pipe.execute()

    def durations(self, pool: str) -> list[float]:
        """Recorded job durations of ``pool`` in seconds, newest first."""
        with self.guard():
            return [
                float(v) for v in self.client.lrange(self.keys.durations(_check_pool(pool)), 0, -1)
            ]

    def queue(self, pool: str) -> list[str]:
        """Holders waiting for a GPU of ``pool``, longest waiter first."""
        with self.guard():
            key = self.keys.waiters(_check_pool(pool))
            return [_text(h) for h in self.client.zrange(key, 0, -1)]
