"""Durable timers in Redis that any coordinator process may fire.

Hedge, cutover, safety and escalation timers must fire on time and must not die with the worker
that armed them, so they are not Celery countdown tasks (a dead worker's ETA task waits for the
broker's visibility timeout, one hour by default). Instead:

* a timer is a member of a ZSET scored by its due time (epoch ms), with its record in a hash;
* :meth:`TimerStore.claim` atomically moves due timers into an in-flight ZSET scored by a lease
  deadline, so two processes never both fire one timer;
* :meth:`TimerStore.ack` removes a fired timer, but only for the claim that is still current;
* an in-flight timer whose lease passed (its claimer died) is claimable again: delivery is
  at least once, so handlers must be idempotent (the race store's version check makes them so).

The thread that fires them is :class:`~gpuhedge_celery.store.timer_service.TimerService`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from ..errors import StoreError, StoreUnavailable
from . import codec
from .connection import primary_changed, translate_errors
from .race_keys import RaceShards, timer_keys
from .scripts import lua_script, queue_script, run_pipeline

log = logging.getLogger(__name__)

ACKED = 1
NOT_IN_FLIGHT = 0
CLAIMED_ELSEWHERE = -1

#: How an arm joins its key's chain (lua/timer_arm.lua): "" not at all, ``HEAD`` as the chain's
#: newest timer, ``IF_IDLE`` the same but only when no timer of the chain waits or is in flight.
HEAD = "head"
IF_IDLE = "idle"
CHAIN_MODES = ("", HEAD, IF_IDLE)


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Translate redis-py errors into the package's :class:`StoreError` branch."""
    with translate_errors():
        try:
            yield
        except redis.ResponseError as e:
            if primary_changed(e):  # a failover: retried like an outage, not a failed command
                raise StoreUnavailable(f"{what}: Redis stopped being the primary ({e})") from e
            raise StoreError(f"{what} failed in Redis: {e}") from e


def as_text(value: Any) -> str:
    """A Redis reply as ``str``, whether the client decodes responses or not."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class Timer:
    """One claimed timer. ``lease_deadline_ms`` identifies the claim when acknowledging it."""

    id: str
    key: str
    due_ms: int
    payload: dict[str, Any]
    deliveries: int
    lease_deadline_ms: int


@dataclass(frozen=True)
class Claim:
    """What one claim returned: the timers (earliest first) and when to look again."""

    timers: list[Timer]
    next_ms: int | None  # earliest due time or lease deadline left, None when nothing is left
    acked: list[int] = field(default_factory=list)  # a code per timer acknowledged with it
    cancelled: list[int] = field(default_factory=list)  # a code per timer cancelled with it


class TimerStore:
    """A namespace of durable timers in Redis (keys from :func:`timer_keys`)."""

    def __init__(self, client: Any, prefix: str = "gpuhedge", namespace: str = "timers"):
        self.client = client
        self.keys = timer_keys(prefix, namespace)
        self._arm = lua_script(client, "timer_arm")
        self._claim = lua_script(client, "timer_claim")
        # Cancels this process's timer service sends with its next claim (defer_cancels).
        self._carriers = 0  # services of this store whose claims carry them
        self._deferred: list[str] = []
        self._deferred_lock = threading.Lock()
        self._release = lua_script(client, "timer_release")

    def _arm_args(
        self,
        key: str,
        due_ms: int,
        payload: dict[str, Any],
        timer_id: str | None,
        chain: str = "",
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of lua/timer_arm.lua for one timer; ValueError naming bad input."""
        if not isinstance(key, str) or not key or "\n" in key or len(key) > 300:
            raise ValueError(f"invalid timer key {key!r}: expected 1-300 characters, no newline")
        if chain not in CHAIN_MODES:
            raise ValueError(f"invalid chain mode {chain!r}: expected one of {CHAIN_MODES}")
        if chain and not (timer_id or "").startswith(f"{key}|"):
            want = f"{key}|"  # how timer_claim.lua finds the chain of an acknowledged timer
            raise ValueError(f"a chained timer's id must start with {want!r}, got {timer_id!r}")
        if isinstance(due_ms, bool) or not isinstance(due_ms, int) or due_ms < 0:
            raise ValueError(f"invalid due time {due_ms!r}: expected epoch milliseconds (int)")
        if not isinstance(payload, dict):
            raise ValueError(f"invalid timer payload for {key!r}: expected a dict")
        try:
            record = codec.dumps({"key": key, "due": due_ms, "payload": payload})
        except (TypeError, ValueError) as e:
            raise ValueError(f"timer payload for {key!r} is not JSON-serialisable: {e}") from None
        k = self.keys
        keys = [k.due, k.data, k.seq, k.inflight, k.chains]
        return keys, [key, due_ms, record, timer_id or "", k.channel, chain]

    def arm(
        self,
        key: str,
        due_ms: int,
        payload: dict[str, Any],
        *,
        timer_id: str | None = None,
        chain: str = "",
    ) -> str:
        """Schedule a timer due at ``due_ms`` (epoch ms) and return its id (``key|seq``).

        With an explicit ``timer_id`` arming is idempotent: arming an id that is already
        waiting or in flight changes nothing (a redelivered task may arm twice).

        ``chain``: timers that each arm the next under one key (a job's watch polls) are a
        chain. ``HEAD`` records this timer as its chain's newest (its id must start with
        ``key|``); ``IF_IDLE`` arms it only when the chain has no timer waiting or in flight
        and otherwise returns the id of the one it has, so a recovery that cannot know
        whether a chain survived never starts a second one. A timer leaves its chain when it
        is acknowledged or cancelled.
        """
        keys, args = self._arm_args(key, due_ms, payload, timer_id, chain)
        with store_errors("arming a timer"):
            found = self._arm(keys=keys, args=args)
        return as_text(found[0])

    def arm_many(self, items: Iterable[tuple[str, int, dict[str, Any]]]) -> list[str]:
        """Arm several ``(key, due_ms, payload)`` timers in one round trip; returns their ids."""
        queued = [self._arm_args(key, due_ms, payload, None) for key, due_ms, payload in items]

        def build(pipe: Any) -> None:
            for keys, args in queued:
                queue_script(pipe, self._arm, keys, args)

        with store_errors("arming timers"):
            return [as_text(found[0]) for found in run_pipeline(self.client, build, [self._arm])]

    def queue_arm(
        self,
        pipe: Any,
        key: str,
        due_ms: int,
        payload: dict[str, Any],
        timer_id: str,
        chain: str = "",
    ) -> None:
        """Queue an idempotent arming (fixed ``timer_id``) on someone else's pipeline
        (``chain`` as for :meth:`arm`).

        The caller runs the pipeline with :func:`~gpuhedge_celery.store.scripts.run_pipeline`
        and passes :attr:`arm_script` among its scripts.
        """
        keys, args = self._arm_args(key, due_ms, payload, timer_id, chain)
        queue_script(pipe, self._arm, keys, args)

    @property
    def arm_script(self) -> Any:
        return self._arm

    def _claim_args(
        self,
        now_ms: int,
        limit: int,
        lease_ms: int,
        ahead_ms: int,
        acks: Iterable[Timer] = (),
        cancels: Iterable[str] = (),
    ) -> list[Any]:
        pairs: list[Any] = []
        for t in acks:
            pairs += [t.id, t.lease_deadline_ms]
        return [now_ms, limit, lease_ms, ahead_ms, len(pairs) // 2, *pairs, *cancels]

    @property
    def _claim_keys(self) -> list[str]:
        k = self.keys
        return [k.due, k.inflight, k.data, k.deliveries, k.chains]

    def _claim_none(self, acks: Iterable[Timer] = (), cancels: Iterable[str] = ()) -> Claim:
        """A claim that takes no timer: only acknowledges ``acks`` and cancels ``cancels``."""
        return self.claim(0, 0, 1, 0, acks=acks, cancels=cancels)

    def queue_cancel(self, pipe: Any, timer_id: str) -> None:
        """Queue :meth:`cancel` on someone else's pipeline (pass :attr:`cancel_script`)."""
        args = self._claim_args(0, 0, 1, 0, (), [timer_id])  # a claim of none
        queue_script(pipe, self._claim, self._claim_keys, args)

    @property
    def cancel_script(self) -> Any:
        return self._claim  # a cancel is a claim of none (lua/timer_claim.lua)

    def cancel(self, timer_id: str) -> bool:
        """Remove a timer, waiting or in flight; False when it already fired or never existed."""
        return self.cancel_many([timer_id]) == [1]

    def cancel_many(self, timer_ids: list[str]) -> list[int]:
        """Cancel several timers in one call (a claim of none); 1 per timer that existed."""
        return self._claim_none(cancels=timer_ids).cancelled if timer_ids else []

    def defer_cancels(self, timer_ids: list[str]) -> None:
        """Cancel timers nobody needs any more, with the next claim of this process's timer
        service when one runs (:attr:`claims_carry_cancels`), else now (one round trip).

        Only for timers whose firing would be harmless (a race ignores a timer it no longer
        wants): a cancel that waits may come after the timer fired, and one still waiting when
        its process dies is never sent."""
        if not timer_ids:
            return
        if self.claims_carry_cancels:
            with self._deferred_lock:
                self._deferred.extend(timer_ids)
            return
        self.cancel_many(timer_ids)

    @property
    def claims_carry_cancels(self) -> bool:
        """Whether a timer service of this store carries deferred cancels in its claims."""
        return self._carriers > 0

    def carry_cancels(self, on: bool) -> None:
        """A service starts (``on``) or stops carrying deferred cancels in its claims (counted:
        a shard's old service may still be stopping while its new one runs)."""
        with self._deferred_lock:
            self._carriers = max(0, self._carriers + (1 if on else -1))

    def take_deferred(self) -> list[str]:
        """The cancels :meth:`defer_cancels` left for the next claim (the caller sends them)."""
        with self._deferred_lock:
            found, self._deferred = self._deferred, []
        return found

    def keep_deferred(self, timer_ids: list[str]) -> None:
        """Put back cancels a failed claim did not send."""
        with self._deferred_lock:
            self._deferred[:0] = timer_ids

    def claim(
        self,
        now_ms: int,
        limit: int = 100,
        lease_ms: int = 10_000,
        ahead_ms: int = 0,
        acks: Iterable[Timer] = (),
        cancels: Iterable[str] = (),
    ) -> Claim:
        """Atomically take up to ``limit`` timers due at ``now_ms``, each leased for ``lease_ms``.

        Timers whose earlier claim's lease has passed are taken first. Nothing else can claim a
        taken timer until ``now + lease_ms``; acknowledge it before then. With ``ahead_ms`` it
        also takes timers due up to that much later: the caller fires each at its due time.
        ``acks``: fired timers to acknowledge first, in the same script (see :meth:`ack_many`;
        their codes are the claim's ``acked``); ``cancels``: timer ids to cancel next (see
        :meth:`cancel`; codes in ``cancelled``). ``limit`` 0 claims nothing.
        """
        if limit < 0 or lease_ms < 1 or ahead_ms < 0:
            raise ValueError(
                f"claim needs limit >= 0, lease_ms >= 1 and ahead_ms >= 0, "
                f"got {limit}, {lease_ms}, {ahead_ms}"
            )
        args = self._claim_args(now_ms, limit, lease_ms, ahead_ms, acks, cancels)
        with store_errors("claiming due timers"):
            raw = self._claim(keys=self._claim_keys, args=args)
        deadline, next_ms, acked = int(raw[0]), int(raw[1]), int(raw[2])
        cancelled = int(raw[3 + acked])
        first = 4 + acked + cancelled  # the first claimed timer's id
        timers = []
        for i in range(first, len(raw), 3):
            record = codec.loads(raw[i + 1])
            timers.append(
                Timer(
                    id=as_text(raw[i]),
                    key=record["key"],
                    due_ms=int(record["due"]),
                    payload=record["payload"],
                    deliveries=int(raw[i + 2]),
                    lease_deadline_ms=deadline,
                )
            )
        timers.sort(key=lambda t: t.due_ms)
        return Claim(
            timers=timers,
            next_ms=None if next_ms < 0 else next_ms,
            acked=[int(c) for c in raw[3 : 3 + acked]],
            cancelled=[int(c) for c in raw[4 + acked : first]],
        )

    def claim_due(self, now_ms: int, limit: int = 100, lease_ms: int = 10_000) -> list[Timer]:
        """The timers of :meth:`claim`, earliest due first."""
        return self.claim(now_ms, limit, lease_ms).timers

    def ack(self, timer: Timer) -> bool:
        """Mark a fired timer done; False when the claim is no longer current (see ack_many)."""
        return self.ack_many([timer])[0] == ACKED

    def ack_many(self, timers: list[Timer]) -> list[int]:
        """Acknowledge several timers in one call (a claim of none); one code per timer.

        ``ACKED`` removed; ``NOT_IN_FLIGHT`` cancelled or already acknowledged;
        ``CLAIMED_ELSEWHERE`` its lease ran out and another process claimed it again.
        """
        if not timers:
            return []
        return self._claim_none(acks=timers).acked

    def release(self, timers: list[Timer]) -> int:
        """Give claimed timers back unfired (to wait again at their due time, this delivery not
        counted), where the claim is still current; returns how many were given back."""
        if not timers:
            return 0
        args: list[Any] = []
        for t in timers:
            args += [t.id, t.lease_deadline_ms, t.due_ms]
        k = self.keys
        with store_errors("releasing timers"):
            return int(self._release(keys=[k.due, k.inflight, k.deliveries], args=args))

    def pending(self) -> int:
        """How many timers wait to become due (not counting those in flight)."""
        with store_errors("counting timers"):
            return int(self.client.zcard(self.keys.due))

    def in_flight(self) -> int:
        """How many timers are claimed and not yet acknowledged."""
        with store_errors("counting timers"):
            return int(self.client.zcard(self.keys.inflight))

    def due_time(self, timer_id: str) -> int | None:
        """The due time of a waiting timer, None if it is not waiting."""
        with store_errors("reading a timer"):
            score = self.client.zscore(self.keys.due, timer_id)
        return None if score is None else int(score)


class RaceTimers:
    """The timers of races: one :class:`TimerStore` per race shard (``shards.tags``), a race's
    timers in its shard's namespace, so they share a Cluster slot with the race's keys and a
    save's arms ride in one slot with it. With one shard it is the single namespace of old."""

    def __init__(self, client: Any, shards: RaceShards):
        self.shards = shards
        self.stores = tuple(TimerStore(client, shards.prefix, tag) for tag in shards.tags)
        self._by_tag = dict(zip(shards.tags, self.stores, strict=True))

    def of(self, race_id: str) -> TimerStore:
        """The timer store of race ``race_id``'s shard."""
        return self._by_tag[self.shards.tag_of(race_id)]

    @property
    def arm_script(self) -> Any:
        return self.stores[0].arm_script  # one script per client, whatever the namespace

    @property
    def cancel_script(self) -> Any:
        return self.stores[0].cancel_script

    def pending(self) -> int:
        """Timers waiting to become due, on every shard."""
        return sum(store.pending() for store in self.stores)

    def in_flight(self) -> int:
        """Timers claimed and not yet acknowledged, on every shard."""
        return sum(store.in_flight() for store in self.stores)
