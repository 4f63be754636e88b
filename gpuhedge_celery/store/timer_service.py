"""The thread that fires durable timers (:mod:`.timers`) in this process (its handler threads,
with ``threads > 1``, are in :mod:`.timer_workers`), and :class:`TimerServices`, a process's
timer coordinator: one such thread per race shard dealt to it.

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
from collections.abc import Callable
from typing import Any

from ..core.clock import Clock, WallClock
from ..core.shard_deal import dealt_shards, helped_shards
from ..metrics import record as metrics
from .timer_coordinators import (
    BEAT_MS,
    HELP_BEHIND_MS,
    HELP_EVERY_MS,
    LEASE_MS,
    Coordinators,
    coordinator_id,
)
from .timer_workers import BatchHandler, TimerWorkers, _Job
from .timers import RaceTimers, Timer, TimerStore

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
        behind_ms: int = 0,
    ):
        if idle_ms < 1:
            raise ValueError(f"idle_ms must be >= 1, got {idle_ms}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if ahead_ms < 0 or (ahead_ms and threads == 1):
            raise ValueError(f"ahead_ms must be >= 0, and 0 with one thread; got {ahead_ms}")
        if batch_handler is not None and threads == 1:
            raise ValueError("a batch_handler needs threads > 1 for the timers it hands back")
        if behind_ms < 0 or (behind_ms and ahead_ms):
            raise ValueError(f"behind_ms must be >= 0, and 0 with ahead_ms; got {behind_ms}")
        self.store = store
        self.handler = handler
        self.batch_handler = batch_handler
        self.batch = batch
        self.lease_ms = lease_ms
        # Without wake-up messages only polling bounds the lag, so poll often; a helper
        # (behind_ms) polls every idle_ms: it only takes what is already that late.
        self.behind_ms = behind_ms
        self.idle_ms = idle_ms if use_pubsub or behind_ms else min(idle_ms, 5)
        self.use_pubsub = use_pubsub and not behind_ms
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
        # For stalled(): since when the service thread runs handler code itself (None: it does
        # not), and when a handler last finished or work was last handed to the workers.
        self._busy_since: float | None = None
        self._done_at = self._handed_at = time.monotonic()
        self._carrying = False  # whether this service's claims carry the store's cancels

    def now_ms(self) -> int:
        return int(self.clock.now() * 1000)

    def claim_now_ms(self) -> int:
        """The "now" of a claim: a helper's lies ``behind_ms`` back, so it takes only timers
        overdue by that much (the shard's own claimer is behind or gone)."""
        return self.now_ms() - self.behind_ms

    def start(self) -> TimerService:
        """Start the thread (once), and the worker threads when ``threads > 1``; returns self.

        With worker threads, the store's deferred cancels (:meth:`TimerStore.defer_cancels`)
        ride in this service's claims from now until :meth:`stop`."""
        try:
            self._start_workers()
            if self.threads > 1:
                self.store.carry_cancels(True)
                self._carrying = True
            self._thread.start()
        except BaseException:  # half started (no thread to spare): undo what did start
            self.stop(0)
            raise
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
        if self._carrying:  # another service of this store may carry them on (a shard dealt back)
            self._carrying = False
            self.store.carry_cancels(False)
        if not self.store.claims_carry_cancels:
            self._flush_cancels()
        for _ in self._workers:
            self._jobs.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stalled(self, limit_s: float) -> bool:
        """Whether this service has fired nothing for ``limit_s`` while its handlers hold it:
        the service thread in one handler (or batch) that long, or every worker thread busy
        that long without one finishing; or its thread has died. Idle waits and failing Redis
        calls are not stalls (handing the shard over would not help)."""
        if not self.alive:
            return True
        now = time.monotonic()
        busy_since = self._busy_since
        if busy_since is not None and now - busy_since > limit_s:
            return True
        if self.threads == 1:
            return False
        handlers = self._running - len(self._early)  # handed over, not yet finished
        return handlers >= self.threads and now - max(self._done_at, self._handed_at) > limit_s

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
        claim = self.store.claim(self.claim_now_ms(), self.batch, self.lease_ms)
        done = []
        for timer in claim.timers:
            self._busy_since = time.monotonic()
            try:
                if self._fire(timer):
                    done.append(timer)
            finally:
                self._busy_since = None
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
            self._done_at = time.monotonic()
            with self._counts:
                self.failed += 1
            if timer.deliveries >= self.max_deliveries:
                log.error("timer %s dropped after %d failed deliveries", timer.id, timer.deliveries)
                return True
            log.exception("timer %s handler failed; it will be delivered again", timer.id)
            return False
        self._done_at = time.monotonic()
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
                    if self.behind_ms and claim_at > now - self.behind_ms:
                        claim_at = idle  # nothing overdue enough is left: poll again later
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


def _second_beat(away: dict[int, int], shard: int) -> bool:
    """Count one more beat ``shard`` went without being given here; True, and forgotten, at
    the second (a shard is kept one beat in case the others have not read the deal yet)."""
    away[shard] = away.get(shard, 0) + 1
    if away[shard] < 2:
        return False
    del away[shard]
    return True


class TimerServices:
    """A process's timer coordinator: a :class:`TimerService` for each race shard dealt to it
    (:func:`~gpuhedge_celery.core.shard_deal.dealt_shards`) over the coordinators whose lease
    runs in the registry (:class:`~.timer_coordinators.Coordinators`), and a helper for each
    other shard.

    A beat thread renews this process's lease every ``beat_ms`` and re-reads the deal: a shard
    dealt to it starts a service at once; a shard dealt elsewhere is kept one more beat (the
    coordinator it went to may not have read the deal yet: a shard claimed twice costs claims,
    one claimed by nobody costs lag) and its service is then stopped in the background. A
    coordinator that dies drops out of the others' deal once its lease (``lease_ms`` of the
    registry) lapses. One that stalls (a service whose handlers have held it that long without
    one finishing: :meth:`TimerService.stalled`) ends its lease itself, so the others take its
    shards too while it keeps firing what it can. When the registry cannot be read at start
    the process claims every shard, and on a later failure it keeps what it holds.

    A helper (``help_behind_ms``) polls a shard held elsewhere every ``help_every_ms`` without
    wake-up messages and claims only the timers already that late: the shard's holder is
    behind (one process's CPU saturated while another's idles) or gone (before its lease
    lapses), so work moves to where there is room and a dead holder's timers wait a poll, not
    a lease. Each shard with one holder has one helper, the next coordinator
    (:func:`~gpuhedge_celery.core.shard_deal.helped_shards`), so the polls grow with the
    shards, not with coordinators times shards.

    The services share one budget of ``threads`` handler threads: each gets a share of it by
    the shards held when it starts (at least 2 when ``threads > 1``, as a batch handler needs),
    so a process holding 12 shards runs about as many handler threads as one holding one,
    plus a service thread and a pub/sub connection per shard; a helper gets a share by the
    shard count. ``options`` are the services' other keyword arguments (``ahead_ms`` applies
    only to services with a pool that are not helpers, so it is dropped elsewhere).
    """

    def __init__(
        self,
        timers: RaceTimers,
        handler: TimerHandler,
        *,
        threads: int = 1,
        name: str = "gpuhedge-timers",
        me: str | None = None,
        beat_ms: int = BEAT_MS,
        coordinator_lease_ms: int = LEASE_MS,
        help_behind_ms: int = HELP_BEHIND_MS,
        help_every_ms: int = HELP_EVERY_MS,
        **options: Any,
    ):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if not 0 < beat_ms < coordinator_lease_ms:
            raise ValueError(
                f"beat_ms must be > 0 and under coordinator_lease_ms, got {beat_ms} and "
                f"{coordinator_lease_ms}"
            )
        if help_behind_ms < 1 or help_every_ms < 1:
            raise ValueError(
                f"help_behind_ms and help_every_ms must be >= 1, got {help_behind_ms} and "
                f"{help_every_ms}"
            )
        self.timers = timers
        self.handler = handler
        self.threads = threads
        self.name = name
        self.me = me or coordinator_id()
        self.beat_ms = beat_ms
        self.coordinator_lease_ms = coordinator_lease_ms
        self.help_behind_ms = help_behind_ms
        self.help_every_ms = help_every_ms
        self.options = options
        shards = timers.shards
        self.coordinators = Coordinators(timers.stores[0].client, shards.prefix, shards.namespace)
        self.last_error: BaseException | None = None
        self._held: dict[int, TimerService] = {}
        self._helping: dict[int, TimerService] = {}  # the shards held elsewhere
        self._dealt_away: dict[int, int] = {}  # held shard -> beats it has been dealt elsewhere
        # Services stopped (their counts still count; a late handler adds to them), and the
        # threads stopping them.
        self._retired: list[TimerService] = []
        self._retired_counts = [0, 0]  # fired, failed of retired services forgotten since
        self._unhelped: dict[int, int] = {}  # helped shard -> beats it has not been given
        self._retiring: list[threading.Thread] = []
        self._lock = threading.Lock()  # _held, _helping, _retired, _retiring
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._run, name=f"{name}-beat", daemon=True)

    def _service(self, shard: int, held: int) -> TimerService:
        """A service for ``shard``, its share of the threads for ``held`` shards held."""
        share = 1 if self.threads == 1 else max(2, math.ceil(self.threads / held))
        options = dict(self.options)
        if share == 1:
            options.pop("ahead_ms", None)
        # The re-read only covers a lost wake-up message: spread over the shards held, a
        # process re-reads as often holding 12 shards as holding one.
        options["idle_ms"] = int(options.get("idle_ms", IDLE_MS)) * held
        return TimerService(
            self.timers.stores[shard], self.handler, threads=share, name=self._named(shard),
            **options,
        )  # fmt: skip

    def _helper(self, shard: int) -> TimerService:
        """A helper for ``shard``, held elsewhere (see the class docstring)."""
        count = self.timers.shards.count
        share = 1 if self.threads == 1 else max(2, math.ceil(self.threads / count))
        options = {k: v for k, v in self.options.items() if k not in ("ahead_ms", "idle_ms")}
        return TimerService(
            self.timers.stores[shard], self.handler, threads=share,
            name=f"{self._named(shard)}-help", idle_ms=self.help_every_ms,
            behind_ms=self.help_behind_ms, **options,
        )  # fmt: skip

    def _named(self, shard: int) -> str:
        return self.name if self.timers.shards.count == 1 else f"{self.name}-{shard}"

    def start(self) -> TimerServices:
        """Take this process's part of the shards (every shard when the registry cannot be
        read now) and start the beat thread; returns self."""
        try:
            deal = self._deal()
        except Exception as e:
            log.warning("timer coordinators unreadable (%s): claiming every shard for now", e)
            self.last_error = e
            deal = (tuple(range(self.timers.shards.count)), ())
        self._apply(*deal)
        self._beat.start()
        return self

    def _deal(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Renew the lease; the shards to hold and those to help with."""
        live = self.coordinators.beat(self.me, self.coordinator_lease_ms)
        count = self.timers.shards.count
        return dealt_shards(self.me, live, count), helped_shards(self.me, live, count)

    def _apply(self, dealt: tuple[int, ...], helped: tuple[int, ...]) -> None:
        """Start services for shards newly dealt here; stop those dealt away two beats running;
        help with the shards given to help with."""
        stopping: list[TimerService] = []
        with self._lock:
            if self._stop.is_set():
                return
            try:
                for shard in dealt:
                    self._dealt_away.pop(shard, None)
                    if shard not in self._held:
                        self._held[shard] = self._service(shard, len(dealt)).start()
                for shard in [s for s in self._held if s not in dealt]:
                    if _second_beat(self._dealt_away, shard):
                        stopping.append(self._held.pop(shard))
                for shard in [s for s in self._helping if s not in helped or s in self._held]:
                    # kept one more beat like a held shard, unless held here now
                    if _second_beat(self._unhelped, shard) or shard in self._held:
                        self._unhelped.pop(shard, None)
                        stopping.append(self._helping.pop(shard))
                for shard in helped:
                    self._unhelped.pop(shard, None)
                for shard in helped:
                    if shard not in self._held and shard not in self._helping:
                        self._helping[shard] = self._helper(shard).start()
            finally:  # what was taken out is stopped even when starting another failed
                self._retired.extend(stopping)
                for service in stopping:
                    self._retire(service)
                self._retiring = [t for t in self._retiring if t.is_alive()]
                self._fold_retired()

    def _fold_retired(self) -> None:
        """Count the retired services that are done for good and forget them (held lock)."""
        done = [s for s in self._retired if not s.alive and not s.running]
        for service in done:
            self._retired_counts[0] += service.fired
            self._retired_counts[1] += service.failed
        self._retired = [s for s in self._retired if s not in done]

    def _retire(self, service: TimerService) -> None:
        """Stop ``service`` in the background: its running handlers finish and are acknowledged
        without holding up the beat (a handler running past its claim's lease is delivered
        again anyway, so that is as long as it is waited for)."""
        try:
            retire = threading.Thread(
                target=service.stop, args=(service.lease_ms / 1000,),
                name=f"{self.name}-retire", daemon=True,
            )  # fmt: skip
            retire.start()
        except RuntimeError:  # no thread to spare: stop it claiming now, unwaited
            service.stop(0)
            return
        self._retiring.append(retire)

    def _run(self) -> None:
        stalled = False
        while not self._stop.wait(self.beat_ms / 1000):
            try:
                if self._stalled():
                    # stuck here, its shards would wait for it: end its lease so the others
                    # take them too, and keep firing what it can
                    self.coordinators.leave(self.me)
                    if not stalled:
                        log.warning("timer coordinator %s stalled: its shards handed over", self.me)
                    stalled = True
                    continue
                stalled = False
                deal = self._deal()
            except Exception as e:  # keep what this process holds; the next beat retries
                self.last_error = e
                log.warning("timer coordinator beat failed: %s; keeping its shards", e)
                continue
            try:
                self._apply(*deal)
            except Exception as e:  # leased but not firing its part: let the others have it
                self.last_error = e
                log.error("timer coordinator %s could not take its shards: %s", self.me, e)
                with contextlib.suppress(Exception):
                    self.coordinators.leave(self.me)
        if self._stop.is_set():  # a beat still running when stop() left must not outlast it
            with contextlib.suppress(Exception):
                self.coordinators.leave(self.me)

    def _stalled(self) -> bool:
        limit_s = self.coordinator_lease_ms / 1000
        return any(service.stalled(limit_s) for service in self.services)

    def stop(self, timeout: float = 5.0) -> None:
        """End this process's lease so the others take its shards at their next beat, then
        stop every service, at most ``timeout`` seconds in all (:meth:`TimerService.stop`)."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._beat.is_alive():  # no beat may renew the lease after it ended
            self._beat.join(min(timeout, 2 * self.beat_ms / 1000))
        with contextlib.suppress(Exception):  # a lease left behind lapses on its own
            self.coordinators.leave(self.me)
        with self._lock:
            services = [*self._held.values(), *self._helping.values()]
            retiring = list(self._retiring)
        for service in services:
            service._stop.set()  # all stop claiming at once, then each is waited for
        for service in services:
            service.stop(max(0.0, deadline - time.monotonic()))
        for thread in retiring:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def services(self) -> list[TimerService]:
        """The services of the shards this process holds, by shard (not its helpers)."""
        with self._lock:
            return [self._held[shard] for shard in sorted(self._held)]

    @property
    def helpers(self) -> list[TimerService]:
        """The helpers of the shards held elsewhere, by shard."""
        with self._lock:
            return [self._helping[shard] for shard in sorted(self._helping)]

    @property
    def shards(self) -> tuple[int, ...]:
        """The shards this process holds now."""
        with self._lock:
            return tuple(sorted(self._held))

    @property
    def alive(self) -> bool:
        """Whether the beat and every held shard's service run (a shard nobody fires is a
        stuck shard)."""
        services = self.services
        return self._beat.is_alive() and bool(services) and all(s.alive for s in services)

    def _all(self) -> tuple[TimerService, ...]:
        return (*self._retired, *self._held.values(), *self._helping.values())

    @property
    def fired(self) -> int:
        with self._lock:
            return self._retired_counts[0] + sum(s.fired for s in self._all())

    @property
    def failed(self) -> int:
        with self._lock:
            return self._retired_counts[1] + sum(s.failed for s in self._all())
