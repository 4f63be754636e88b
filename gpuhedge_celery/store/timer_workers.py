"""The worker threads of a :class:`~.timer_service.TimerService` with ``threads > 1``.

Mixed into the service: the pool of handler threads and its slots, handing claimed timers to
them (at their due time, or first to a batch handler), and the acknowledgements of finished
timers, which ride in the service thread's next claim.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..metrics import record as metrics
from .timers import Timer, TimerStore

log = logging.getLogger(__name__)

_Work = Callable[[], Any]
#: ``batch_handler(timers, hand_back)``: handles what it can of ``timers`` together and calls
#: ``hand_back(timer, work)`` for each of the others, ``work`` run instead of the handler (None:
#: the handler)
BatchHandler = Callable[[list[Timer], Callable[[Timer, "_Work | None"], None]], None]
_Job = tuple[Timer, "_Work | None"]  # a timer for a worker, and what to run for it
BATCH_PER_SLOT = 4  # timers a batched claim takes per free worker thread


class TimerWorkers:
    """The handler threads, their slots and acknowledgements; needs the service (see module)."""

    store: TimerStore
    threads: int
    batch: int
    ack_delay_ms: int
    lease_ms: int
    ahead_ms: int
    batch_handler: BatchHandler | None
    fired: int
    last_error: BaseException | None
    _name: str
    _stop: threading.Event
    _counts: threading.Lock
    _slots: threading.Condition
    _running: int
    _jobs: queue.SimpleQueue[_Job | None]
    _workers: list[threading.Thread]
    _finished: list[Timer]
    _ack_by: float | None
    _early: list[tuple[int, int, Timer]]
    _early_seq: itertools.count[int]
    _busy_since: float | None
    _done_at: float
    _handed_at: float

    def now_ms(self) -> int:
        raise NotImplementedError

    def claim_now_ms(self) -> int:
        raise NotImplementedError

    def _fire(self, timer: Timer, work: _Work | None = None) -> bool:
        raise NotImplementedError

    # -- worker pool (threads > 1) ------------------------------------------------------------

    def _start_workers(self) -> None:
        if self.threads == 1 or self._workers:
            return
        for i in range(self.threads):
            worker = threading.Thread(target=self._work, name=f"{self._name}-{i + 1}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _submit_once(self) -> int | None:
        self._start_workers()
        with self._slots:
            free = self.threads - self._running
        if free > 0 and self.batch_handler is not None:
            # Handled here together; what it hands back queues for a worker. At most
            # BATCH_PER_SLOT per free worker, so timers handed back never wait long enough in
            # that queue for their lease to lapse, even when none of them batches (a provider
            # that answers one poll at a time, over HTTP).
            free = min(self.batch, free * BATCH_PER_SLOT)
        if free <= 0:
            if self._ack_is_due():
                self._flush_acks()
            return self.now_ms()
        acks, cancels = self._take_acks(), self.store.take_deferred()
        try:
            claim = self.store.claim(
                self.claim_now_ms(),
                min(self.batch, free),
                self.lease_ms,
                self.ahead_ms,
                acks=acks,
                cancels=cancels,
            )
        except BaseException:
            self._keep_acks(acks)  # sent again with the next claim
            self.store.keep_deferred(cancels)
            raise
        with self._slots:
            self._running += len(claim.timers)
        for timer in claim.timers:  # earliest due first
            heapq.heappush(self._early, (timer.due_ms, next(self._early_seq), timer))
        self._hand_over_due(self.now_ms())
        return claim.next_ms  # as in run_once: now (or earlier) when more are already due

    def _hand_over_due(self, now_ms: int) -> None:
        """Hand every held timer that is due to the workers (its slot is already counted), or
        first to the batch handler."""
        due = []
        while self._early and self._early[0][0] <= now_ms:
            due.append(heapq.heappop(self._early)[2])
        if due:
            self._handed_at = time.monotonic()
        if due and self.batch_handler is not None:
            self._busy_since = self._handed_at
            try:
                self._fire_batch(due)
            finally:
                self._busy_since = None
            return
        for timer in due:
            self._jobs.put((timer, None))

    def _fire_batch(self, due: list[Timer]) -> None:
        """Give ``due`` to the batch handler; its done timers wait for their acknowledgement,
        the ones it hands back go to the workers.

        Timers handed back queue for the workers; one that waits there until its lease is
        nearly spent is given back to Redis unfired instead (see :meth:`_work`).
        """
        assert self.batch_handler is not None
        handed: set[int] = set()

        def hand_back(timer: Timer, work: _Work | None) -> None:
            if id(timer) not in handed:
                handed.add(id(timer))
                self._jobs.put((timer, work))

        try:
            self.batch_handler(due, hand_back)
        except Exception:
            log.exception("timer batch handler failed; its timers fire one by one")
            for timer in due:
                hand_back(timer, None)
        done = [timer for timer in due if id(timer) not in handed]
        self._done_at = time.monotonic()
        metrics.timers_batched(len(done), len(handed))
        for timer in done:
            metrics.timer_fired(timer.payload, (self.now_ms() - timer.due_ms) / 1000.0)
        if done:
            with self._counts:
                self.fired += len(done)
            with self._slots:
                self._finished.extend(done)
                if self._ack_by is None:
                    self._ack_by = time.monotonic() + self.ack_delay_ms / 1000
                self._running -= len(done)
                self._slots.notify_all()

    def _give_back_early(self) -> None:
        """On stop: timers claimed ahead and not yet due wait in Redis again, for anyone."""
        early, self._early = [t for _, _, t in self._early], []
        self._give_back(early)

    def _give_back(self, timers: list[Timer]) -> None:
        """Release claimed timers unfired (this delivery not counted) and free their slots."""
        if not timers:
            return
        try:
            self.store.release(timers)
        except Exception as e:  # they stay in flight: delivered again after their lease
            log.warning("timer service: giving back %d timers failed: %s", len(timers), e)
        self._free(len(timers))

    def _wait_for_slot(self) -> None:
        """Block until a worker is free or stop() is called (notified, not polled); timers
        held ahead are handed over as they come due meanwhile."""
        while True:
            self._hand_over_due(self.now_ms())
            with self._slots:
                if self._running < self.threads or self._stop.is_set():
                    return
                timeout = 1.0
                if self._early:
                    timeout = min(timeout, max(0.0005, (self._early[0][0] - self.now_ms()) / 1000))
                self._slots.wait(timeout)

    def _free(self, n: int) -> None:
        with self._slots:
            self._running -= n
            self._slots.notify_all()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            timer, work = job
            done = False
            try:
                if work is None and self._lease_nearly_spent(timer):
                    self._release_unfired(timer)
                    continue
                # After stop() nothing starts: the timer stays in flight for redelivery.
                done = not self._stop.is_set() and self._fire(timer, work)
            finally:
                with self._slots:
                    if done:  # acknowledged with the next claim (see the class docstring)
                        self._finished.append(timer)
                        if self._ack_by is None:
                            self._ack_by = time.monotonic() + self.ack_delay_ms / 1000
                    self._running -= 1
                    self._slots.notify_all()

    def _lease_nearly_spent(self, timer: Timer) -> bool:
        """Whether ``timer`` waited for a worker until less than a quarter of its lease is
        left (a batched claim queued it behind slow handlers): fired now, it could still be
        running when the lease lapses and another process takes it too."""
        return timer.lease_deadline_ms - self.now_ms() < self.lease_ms // 4

    def _release_unfired(self, timer: Timer) -> None:
        """Give a timer that never started back to Redis, for the next claim (its delivery
        not counted); should that fail it stays in flight until its lease lapses."""
        try:
            self.store.release([timer])
        except Exception as e:
            log.warning("timer service: giving back timer %s failed: %s", timer.id, e)

    # -- acknowledgements (threads > 1) --------------------------------------------------------

    def _take_acks(self) -> list[Timer]:
        with self._slots:
            acks, self._finished, self._ack_by = self._finished, [], None
        return acks

    def _keep_acks(self, acks: list[Timer]) -> None:
        """Put back acknowledgements that were not sent (due again at once)."""
        if not acks:
            return
        with self._slots:
            self._finished[:0] = acks
            self._ack_by = time.monotonic()

    def _ack_is_due(self) -> bool:
        with self._slots:
            return self._ack_by is not None and time.monotonic() >= self._ack_by

    def _flush_cancels(self) -> None:
        """On stop: the deferred cancels no claim will carry now (best effort: a timer left
        uncancelled fires and is ignored)."""
        cancels = self.store.take_deferred()
        if not cancels:
            return
        try:
            self.store.cancel_many(cancels)
        except Exception as e:
            log.warning("timer service: cancelling %d timers failed: %s", len(cancels), e)

    def _flush_acks(self) -> None:
        """Acknowledge the finished timers now, without a claim (one round trip)."""
        acks = self._take_acks()
        if not acks:
            return
        try:
            self.store.ack_many(acks)
        except Exception as e:  # they stay in flight and are delivered again after their lease
            self.last_error = e
            log.warning("timer service: acknowledging %d timers failed: %s", len(acks), e)
            if not self._stop.is_set():
                self._keep_acks(acks)
