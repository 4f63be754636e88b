"""The thread that fires durable timers (:mod:`.timers`) in this process (its handler threads,
with ``threads > 1``, are in :mod:`.timer_workers`), and :class:`TimerServices`, one such
thread per namespace of a sharded deployment (race shards).

:class:`TimerService` is a daemon thread per process that sleeps until the earliest due time,
woken early by a pub/sub message when an earlier timer is armed, and re-reads at least every
``idle_ms`` in case a message was lost (pub/sub is fire-and-forget). With ``threads > 1`` it
hands each claimed timer to one of that many worker threads, so handlers that wait on Redis
overlap instead of queueing behind each other.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..core.clock import Clock, WallClock
from ..metrics import record as metrics
from .timer_workers import BatchHandler, TimerWorkers, _Job
from .timers import Timer, TimerStore

log = logging.getLogger(__name__)

TimerHandler = Callable[[Timer], None]
IDLE_MS = 100  # how often a service re-reads its due timers without a wake-up message


class TimerService(TimerWorkers):
    """A daemon thread that fires a namespace's timers in this process (start one per process).

    For each claimed timer it calls ``handler(timer)`` and acknowledges the timer once the
    handler returns. A handler that raises leaves its timer in flight, so it is delivered again
    after ``lease_ms`` (up to ``max_deliveries`` times, then dropped with an error in the log).

    With ``threads == 1`` (the default) handlers run one after another in the service thread and
    a claim's lease covers its whole batch, so handlers should be short (send a task, write a
    flag).

    With ``threads > 1`` handlers run concurrently on that many daemon worker threads, so the
    handler must be thread-safe. The service thread claims only as many timers as there are
    free slots (claimed timers whose handler has not finished never number more than
    ``threads``, so none waits here for a worker and a lease is spent on its own handler),
    hands them over earliest due first, and sleeps until a slot frees when all are busy. A
    finished timer frees its slot at once; its acknowledgement waits for the service thread's
    next claim and rides in it (one script, one round trip for both), or goes alone once it
    has waited ``ack_delay_ms``. Until acknowledged it stays in flight in Redis, where only its
    lease (far longer) would make it due again.

    With ``ahead_ms`` (a pool only) a claim also takes the timers due within that many ms; the
    service thread holds them (each holds a slot) and hands each over at its due time, so a
    window of timers costs one claim instead of one each, and processes that wake for the same
    due time do not each claim once per timer. On stop, held timers are given back to wait in
    Redis again (this delivery not counted).

    With ``batch_handler`` (a pool only) the service thread gives each claimed batch of due
    timers to ``batch_handler(timers, hand_back)`` itself: it handles what it can of them
    together and hands back the rest, each at once to the worker threads, which fire them one
    by one as usual. A timer it does not hand back is done when it returns, and acknowledged
    with the next claim. A claim then takes up to ``BATCH_PER_SLOT`` timers per free worker
    (at most ``batch``; :mod:`.timer_workers`). If it raises, every timer of the batch not
    handed back yet is handed to the workers.
    """

    def __init__(
        self,
        store: TimerStore,
        handler: TimerHandler,
        *,
        batch: int = 200,
        lease_ms: int = 10_000,
        idle_ms: int = IDLE_MS,
        use_pubsub: bool = True,
        max_deliveries: int = 10,
        threads: int = 1,
        ahead_ms: int = 0,
        ack_delay_ms: int = 50,
        clock: Clock | None = None,
        name: str = "gpuhedge-timers",
        batch_handler: BatchHandler | None = None,
    ):
        if idle_ms < 1:
            raise ValueError(f"idle_ms must be >= 1, got {idle_ms}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if ahead_ms < 0 or (ahead_ms and threads == 1):
            raise ValueError(f"ahead_ms must be >= 0, and 0 with one thread; got {ahead_ms}")
        if batch_handler is not None and threads == 1:
            raise ValueError("a batch_handler needs threads > 1 for the timers it hands back")
        self.store = store
        self.handler = handler
        self.batch_handler = batch_handler
        self.batch = batch
        self.lease_ms = lease_ms
        # Without wake-up messages only polling bounds the lag, so poll often.
        self.idle_ms = idle_ms if use_pubsub else min(idle_ms, 5)
        self.use_pubsub = use_pubsub
        self.max_deliveries = max_deliveries
        self.threads = threads
        self.ahead_ms = ahead_ms
        if not 0 <= ack_delay_ms < lease_ms:
            raise ValueError(f"ack_delay_ms must be >= 0 and under lease_ms, got {ack_delay_ms}")
        self.ack_delay_ms = ack_delay_ms
        self.clock = clock or WallClock()
        self.fired = 0
        self.failed = 0
        self.last_error: BaseException | None = None
        self._name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pubsub: Any = None
        self._counts = threading.Lock()  # fired, failed
        # Worker pool (threads > 1): _running counts timers claimed and not yet finished.
        self._slots = threading.Condition()
        self._running = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        # Finished timers waiting for their acknowledgement, and when it is due at the latest
        # (monotonic seconds; None when none waits); guarded by _slots.
        self._finished: list[Timer] = []
        self._ack_by: float | None = None
        # Timers claimed ahead of their due time (ahead_ms), held here until due; each holds a
        # slot. Only the service thread touches it.
        self._early: list[tuple[int, int, Timer]] = []
        self._early_seq = itertools.count()

    def now_ms(self) -> int:
        return int(self.clock.now() * 1000)

    def start(self) -> TimerService:
        """Start the thread (once), and the worker threads when ``threads > 1``; returns self.

        With worker threads, the store's deferred cancels (:meth:`TimerStore.defer_cancels`)
        ride in this service's claims from now until :meth:`stop`."""
        self._start_workers()
        if self.threads > 1:
            self.store.claims_carry_cancels = True
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop and wait for it, at most ``timeout`` seconds in all.

        With ``threads == 1`` the claimed batch is finished first. With ``threads > 1`` running
        handlers are waited for and acknowledged, no handler starts after this call (a timer
        claimed but not yet started stays in flight and is delivered again after its lease),
        and the worker threads exit.
        """
        deadline = time.monotonic() + timeout
        self._stop.set()
        with self._slots:
            self._slots.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._workers:
            return
        with self._slots:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._slots.wait(left)
        self._flush_acks()
        self.store.claims_carry_cancels = False
        self._flush_cancels()
        for _ in self._workers:
            self._jobs.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        """Timers handed to worker threads and not yet acknowledged (or given up on)."""
        with self._slots:
            return self._running

    def run_once(self) -> int | None:
        """Claim and fire one batch; returns when to look again (epoch ms), None if idle.

        With ``threads > 1`` it claims at most as many timers as there are free workers and
        returns once they are handed over, without waiting for their handlers.
        """
        if self.threads > 1:
            return self._submit_once()
        claim = self.store.claim(self.now_ms(), self.batch, self.lease_ms)
        done = []
        for timer in claim.timers:
            if self._fire(timer):
                done.append(timer)
        if done:
            self.store.ack_many(done)
        # The claim says when the next timer is due (now or earlier when one batch did not hold
        # all that were due): no second claim just to learn that nothing else is due yet.
        return claim.next_ms

    def _fire(self, timer: Timer, work: Callable[[], Any] | None = None) -> bool:
        """Run the handler (or ``work``, given for it by the batch handler); True when the
        timer is done (fired, or dropped after its last try)."""
        metrics.timer_fired(timer.payload, (self.now_ms() - timer.due_ms) / 1000.0)
        try:
            if work is None:
                self.handler(timer)
            else:
                work()
        except Exception:
            with self._counts:
                self.failed += 1
            if timer.deliveries >= self.max_deliveries:
                log.error("timer %s dropped after %d failed deliveries", timer.id, timer.deliveries)
                return True
            log.exception("timer %s handler failed; it will be delivered again", timer.id)
            return False
        with self._counts:
            self.fired += 1
        return True

    def _wait(self, ms: int) -> bool:
        """Sleep ``ms``; True when a wake-up message (an earlier timer was armed) ended it."""
        if ms <= 0:
            return False
        if self._pubsub is None:
            self._stop.wait(ms / 1000)
            return False
        # Wait in slices so stop() is honoured promptly even during a long idle wait, and so
        # a timer that finishes meanwhile gets its acknowledgement out within ack_delay_ms.
        until = time.monotonic() + ms / 1000
        while not self._stop.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return False
            if self._ack_is_due():
                return True  # claim now: the acknowledgement rides in it
            slice_s = 0.25 if not self._running else min(0.25, max(self.ack_delay_ms, 1) / 1000)
            if self._pubsub.get_message(timeout=min(left, slice_s)) is not None:
                # An earlier timer was armed; drain the rest so a burst costs one claim.
                while self._pubsub.get_message(timeout=0) is not None:
                    pass
                return True
        return False

    def _subscribe(self) -> None:
        if not self.use_pubsub:
            return
        self._close_pubsub()
        pubsub = self.store.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.store.keys.channel)
        self._pubsub = pubsub

    def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                self._pubsub.close()
            self._pubsub = None

    def _run(self) -> None:
        backoff = 0.0
        claim_at = 0  # epoch ms of the next claim (0: at once)
        while not self._stop.is_set():
            try:
                if self.threads > 1:
                    self._wait_for_slot()
                    if self._stop.is_set():
                        break
                if self.use_pubsub and self._pubsub is None:
                    # Subscribe before claiming, so no wake-up between the two is missed.
                    self._subscribe()
                    claim_at = 0
                now = self.now_ms()
                if now >= claim_at:
                    next_ms = self.run_once()
                    now = self.now_ms()
                    idle = now + self.idle_ms
                    claim_at = idle if next_ms is None else min(next_ms, idle)
                else:  # woken for a timer held ahead: hand it over, no claim
                    self._hand_over_due(now)
                backoff = 0.0
                wake = min(claim_at, self._early[0][0]) if self._early else claim_at
                if self._wait(wake - self.now_ms()):
                    claim_at = 0
            except Exception as e:  # the thread must not die silently: log, back off, retry
                self.last_error = e
                log.warning("timer service: %s; retrying", e)
                self._close_pubsub()
                backoff = min(max(backoff * 2, 0.05), 2.0)
                self._stop.wait(backoff)
        self._give_back_early()
        self._close_pubsub()


class TimerServices:
    """One :class:`TimerService` per timer store (a race shard's namespace each), sharing one
    budget of ``threads`` handler threads: each service gets its share (at least 2 when
    ``threads > 1``, as a batch handler needs), so a process at 12 shards runs about as many
    handler threads as at one, plus a service thread and a pub/sub connection per shard.

    ``options`` are the services' other keyword arguments (``ahead_ms`` applies only to
    services with a pool, so it is dropped where the share is one thread)."""

    def __init__(
        self,
        stores: Sequence[TimerStore],
        handler: TimerHandler,
        *,
        threads: int = 1,
        name: str = "gpuhedge-timers",
        **options: Any,
    ):
        if not stores:
            raise ValueError("timer services need at least one timer store")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        share = 1 if threads == 1 else max(2, math.ceil(threads / len(stores)))
        if share == 1:
            options.pop("ahead_ms", None)
        # The re-read only covers a lost wake-up message: spread over the shards, a process
        # re-reads as often at 12 shards as at one instead of 12 times as often.
        options["idle_ms"] = int(options.get("idle_ms", IDLE_MS)) * len(stores)
        self.services = [
            TimerService(
                store,
                handler,
                threads=share,
                name=name if len(stores) == 1 else f"{name}-{i}",
                **options,
            )
            for i, store in enumerate(stores)
        ]

    def start(self) -> TimerServices:
        for service in self.services:
            service.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every service, at most ``timeout`` seconds in all (:meth:`TimerService.stop`)."""
        for service in self.services:
            service._stop.set()  # all stop claiming at once, then each is waited for
        deadline = time.monotonic() + timeout
        for service in self.services:
            service.stop(max(0.0, deadline - time.monotonic()))

    @property
    def alive(self) -> bool:
        """Whether every service's thread runs (a shard nobody fires is a stuck shard)."""
        return all(service.alive for service in self.services)

    @property
    def fired(self) -> int:
        return sum(service.fired for service in self.services)

    @property
    def failed(self) -> int:
        return sum(service.failed for service in self.services)
