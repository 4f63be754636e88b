"""Per-process race runtime for the Celery glue: clients, config, providers, the driver, and
the driver's effects done the Celery way (tasks sent by name, the result backend, task events).

This module imports the Celery app only when it is used, never at import, so the runtime's
pieces (and the benchmarks built on them) load without building the app.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, cast

from .. import settings as process_settings
from ..config import GpuHedgeConfig, load_config
from ..core.policy_base import Policy
from ..core.rates import ProviderRate
from ..errors import BudgetExceeded, RaceFailed
from ..metrics import record as metrics
from ..names import TASK_HEDGED_INFER as TASK_HEDGED_INFER
from ..names import TASK_RACE_CANCEL as TASK_RACE_CANCEL
from ..names import TASK_RACE_STEP as TASK_RACE_STEP
from ..names import TASK_RACE_SUBMIT
from ..providers.base import Provider
from ..providers.redis_ledger import install_redis_ledger
from ..race.adaptive import install as install_adaptive
from ..race.attempts import SubmitHow
from ..race.backstops import launch_backstop_id
from ..race.base import RaceParts
from ..race.budget import RaceBudget
from ..race.driver import RaceDriver
from ..race.outcome import TELL_ONCE
from ..race.receipt import by_reference, result_key
from ..race.settings import RaceSettings
from ..race.spec import build_spec
from ..race.watch_batch import WatchBatch
from ..store.adaptive import AdaptiveStore
from ..store.budget import BudgetStore
from ..store.connection import client_for
from ..store.race_keys import RaceShards, ResultWrite
from ..store.races import Keeping, RaceStore
from ..store.redis_clock import RedisClock
from ..store.replicas import ReplicaAcks
from ..store.timer_service import TimerServices
from ..store.timers import RaceTimers

log = logging.getLogger(__name__)

EVENT_BATCH = 200  # task events published together at most


def _app() -> Any:
    from .app import app

    return app


@lru_cache(maxsize=1)
def race_settings() -> RaceSettings:
    """This process's race settings (read from the environment once)."""
    return process_settings.current().race


class CeleryEffects:
    """The driver's effects as Celery does them: tasks, result backend, task events.

    Launches (a hedge, a fallback) run at once on this process's launch threads, and cancels on
    its cancel threads: a hedge is due now and a loser must stop billing, neither should wait
    for a task hop (nor pay for one: a publish, a fetch, an ack and a trace per attempt).
    The driver armed a durable backstop timer first, so a launch or cancel that dies with this
    process is finished by another worker. (``race_submit`` tasks on the attempts queue are
    for operators and other apps.)
    Task events are handed to one sender thread, so a race step never waits on publishing them.
    """

    def __init__(
        self,
        settings: RaceSettings | None = None,
        prefix: str | RaceShards | None = None,
        client: Any = None,
    ) -> None:
        self.settings = settings or race_settings()
        # With the key prefix (or the race store's shards, which carry it), a winner's payload
        # is marked by reference to its stored result where the result backend reads it back
        # (tasks/race_backend.py): Redis gets one copy.
        self.shards: RaceShards | None = (
            prefix
            if isinstance(prefix, RaceShards) or prefix is None
            else RaceShards(prefix, self.settings.timer_namespace, self.settings.race_shards)
        )
        # The race store's client: where the result backend's Redis is the same database, the
        # caller's result is written by the winner claim in the declaring save (result_write).
        self.client = client
        self._lock = threading.Lock()
        self._dispatcher: Any = None
        self._cancels: ThreadPoolExecutor | None = None
        self._launches: ThreadPoolExecutor | None = None
        self.launches_here = True  # read by the driver: it arms each launch's backstop
        self.driver: RaceDriver | None = None  # the driver these effects serve (set with it)
        self._events: queue.SimpleQueue[tuple[str, str, dict[str, Any]] | None] = (
            queue.SimpleQueue()
        )
        self._sender: threading.Thread | None = None
        self.hostname: str | None = None  # the worker's node name, once known

    def launch(self, race_id: str, attempt_id: str, provider: str) -> None:
        self._pool("_launches", "gpuhedge-launch").submit(
            _launch_now, self, race_id, attempt_id, provider
        )

    def cancel(self, race_id: str, attempt_id: str, provider: str) -> None:
        self._pool("_cancels", "gpuhedge-cancel").submit(
            _cancel_now, self, race_id, attempt_id, provider
        )

    def _pool(self, attr: str, name: str) -> ThreadPoolExecutor:
        """The launch or cancel thread pool, started on first use (after any fork)."""
        with self._lock:
            pool = getattr(self, attr)
            if pool is None:
                pool = ThreadPoolExecutor(self.settings.cancel_threads, thread_name_prefix=name)
                setattr(self, attr, pool)
            return pool

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued launches, cancels and events (worker shutdown); backstops cover the
        rest."""
        with self._lock:
            pools = [self._launches, self._cancels]
            self._launches = self._cancels = None
            sender = self._sender
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=False)
        if sender is not None:
            self._events.put(None)
            sender.join(timeout)

    def result_write(self, race_id: str, result: dict[str, Any]) -> ResultWrite | None:
        """The caller's result as the backend would write it, for the winner claim riding in
        the save that declares the winner (one round trip less per race); None where the
        backend cannot say (another backend, another Redis): then :meth:`won` writes it."""
        if self.client is None:
            return None
        backend = _app().backend
        write = getattr(backend, "won_write", None)
        if write is None:
            return None
        try:
            return write(race_id, self._to_store(backend, race_id, result), self.client)
        except Exception:  # the write after the save still works; never fail a step here
            log.debug("race %s: result not prepared for the claim", race_id, exc_info=True)
            return None

    def won(self, race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
        app = _app()
        # a resumed race re-declares its winner: links and chains must not run twice; with
        # replicas to wait for (tell_once), a caller failed already is not told a winner
        told = ("SUCCESS", "FAILURE") if caller.get(TELL_ONCE) else ("SUCCESS",)
        if not caller.get("first_claim") and (
            app.backend.get_task_meta(race_id).get("status") in told
        ):
            return
        if caller.get("result_stored"):  # the claim in the declaring save wrote it
            self._succeeded(race_id, result, caller)
            return
        stored = self._to_store(app.backend, race_id, result)
        if caller.get("first_claim") and hasattr(app.backend, "mark_won"):
            app.backend.mark_won(race_id, stored)  # nothing to read first: see RaceRedisBackend
        else:
            app.backend.mark_as_done(race_id, stored)
        self._succeeded(race_id, result, caller)

    def _succeeded(self, race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
        """After the result is stored: Flower's task-succeeded, then links and the chain."""
        # Flower's "Runtime": the race's, from its start to the winning result (hedged_infer
        # itself returns at once, so Celery's own runtime would be about 0)
        runtime_s = (result.get("e2e_ms") or 0.0) / 1000.0
        self.send(race_id, "task-succeeded", {"result": _short(result), "runtime": runtime_s})
        _continue(race_id, result, caller)

    def _to_store(self, backend: Any, race_id: str, result: dict[str, Any]) -> dict[str, Any]:
        """The winner's result as the backend stores it: its payload by reference when the
        backend reads references back (the caller's ``.get()`` returns ``result`` itself)."""
        if self.shards is None or not self.settings.payload_by_ref:
            return result
        if not getattr(backend, "stores_payload_by_reference", False):
            return result
        # the result key is on the race's shard, as the runtime's store places it
        return by_reference(result, result_key(self.shards, race_id, result["attempt"]))

    def failed(
        self, race_id: str, message: str, receipt: dict[str, Any], caller: dict[str, Any]
    ) -> None:
        backend = _app().backend
        status = backend.get_task_meta(race_id).get("status")
        if status == "FAILURE":
            return  # a resumed race re-finishes: error links must not run twice
        if status == "SUCCESS" and caller.get(TELL_ONCE):
            return  # replicas to wait for: a caller told its winner is never failed after it
        if status == "REVOKED":
            return  # AsyncResult.revoke() stopped it: the caller already has Celery's answer
        reason = receipt.get("failure_reason") or "no_valid_result"
        # its args rebuild it (Celery does cls(*args)): the full message, receipt and reason
        error = (BudgetExceeded if reason == "budget" else RaceFailed)(message, receipt, reason)
        # Given the caller's request, Celery's backend does what its tracer does for any failed
        # task: the rest of a chain is marked failed and the error links (link_error) run.
        backend.mark_as_failure(race_id, error, request=_request(race_id, caller))
        # Celery's task-failed has no runtime; Flower shows this one: the race's, to its end
        created = receipt.get("created_at")
        runtime_s = None if created is None else max(0.0, time.time() - float(created))
        self.send(
            race_id, "task-failed", {"exception": str(error), "traceback": "", "runtime": runtime_s}
        )

    def event(self, race_id: str, name: str, fields: dict[str, Any]) -> None:
        self.send(race_id, f"task-{name}", fields)

    def send(self, race_id: str, kind: str, fields: dict[str, Any]) -> None:
        """Queue one task event for Flower / ``celery events`` (sent in order, off the step)."""
        if not self.settings.events:
            return
        if self._sender is None:
            with self._lock:
                if self._sender is None:
                    self._sender = threading.Thread(
                        target=self._send_loop, name="gpuhedge-race-events", daemon=True
                    )
                    self._sender.start()
        self._events.put((race_id, kind, fields))

    def _send_loop(self) -> None:
        # Whatever queued up within the linger (and while the last batch was published) goes
        # out as one ``task.multi`` message (a list of events; Celery's receivers, Flower's
        # included, unpack it), so the cost is one publish per batch, not one per event.
        linger = self.settings.event_linger_ms / 1000.0
        while True:
            batch = [self._events.get()]
            if linger > 0 and batch[0] is not None:
                # Let more gather: one publish then carries every event of these milliseconds
                # (a publish costs this process and Redis about as much as a race step).
                time.sleep(linger)
            while batch[-1] is not None and len(batch) < EVENT_BATCH:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            events = [item for item in batch if item is not None]
            try:
                if events:
                    if self._dispatcher is None:
                        app = _app()
                        self._dispatcher = app.events.Dispatcher(
                            app.connection_for_write(),
                            enabled=True,
                            hostname=self.hostname,
                            buffer_group=["task"],
                            buffer_limit=EVENT_BATCH + 1,
                        )
                    for race_id, kind, fields in events:
                        self._dispatcher.send(kind, uuid=race_id, **fields)
                    self._dispatcher.flush(errors=False)
            except Exception:  # events are for watching: a failure is logged, never raised
                log.debug("%d race events not sent", len(events), exc_info=True)
                self._dispatcher = None
            if stop:
                return


def _launch_now(effects: CeleryEffects, race_id: str, attempt_id: str, provider: str) -> None:
    """One attempt's submit on a launch thread (see :meth:`CeleryEffects.launch`).

    Flower lists it as the ``race_submit`` task it replaces (task events only, under the id
    ``RACE:ATTEMPT``; no message, no stored result), so the task list still shows who submits
    what for which race.
    """
    # Marked like a task too: logs (and the crash tests) show which worker holds the submit.
    log.info("race_submit[%s:%s] submitting to %s", race_id, attempt_id, provider)
    driver = cast("RaceDriver", effects.driver)
    uuid, started = f"{race_id}:{attempt_id}", time.monotonic()
    effects.send(
        uuid,
        "task-received",
        {
            "name": TASK_RACE_SUBMIT,
            "args": repr((race_id, attempt_id, provider)),
            "kwargs": "{}",
            "root_id": race_id,
            "parent_id": race_id,
            "retries": 0,
            "eta": None,
            "expires": None,
        },
    )
    effects.send(uuid, "task-started", {})
    try:
        how = SubmitHow(decided_here=True, backstop=launch_backstop_id(race_id, attempt_id))
        driver.submit_attempt(race_id, attempt_id, how)
    except Exception as e:  # the backstop timer takes it over; say why here
        log.exception(
            "race %s: launch of %s failed; the backstop timer takes it over", race_id, attempt_id
        )
        effects.send(uuid, "task-failed", {"exception": repr(e), "traceback": ""})
        return
    runtime_s = time.monotonic() - started
    effects.send(uuid, "task-succeeded", {"result": "None", "runtime": runtime_s})


def _cancel_now(effects: CeleryEffects, race_id: str, attempt_id: str, provider: str) -> None:
    """One native cancel on a cancel thread (see :meth:`CeleryEffects.cancel`)."""
    # The marker names the race like a task would, so logs (and the crash tests) show
    # which worker holds the cancel.
    log.info("race_cancel[%s:%s] cancelling %s natively", race_id, attempt_id, provider)
    try:
        cast("RaceDriver", effects.driver).cancel_attempt(race_id, attempt_id)
    except Exception:  # the backstop timer retries it; say why here
        log.exception(
            "race %s: cancel of %s failed; the backstop timer retries it", race_id, attempt_id
        )


def _continue(race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
    """Do what Celery's tracer would have done on success: run links and the next chain step.

    ``hedged_infer`` returns before its result exists (and hands its links to the race), so
    Celery itself does not.
    """
    from celery import signature

    app = _app()
    options = {"parent_id": race_id, "root_id": caller.get("root_id") or race_id}
    for callback in caller.get("callbacks") or []:
        signature(callback, app=app).apply_async((result,), **options)
    chain = list(caller.get("chain") or [])
    if chain:
        following = signature(chain.pop(), app=app)
        following.apply_async((result,), chain=chain or None, **options)


def _request(race_id: str, caller: dict[str, Any]) -> Any:
    """The parts of ``hedged_infer``'s request that a failure's follow-ups need."""
    from celery.app.task import Context

    return Context(
        id=race_id,
        task=TASK_HEDGED_INFER,
        root_id=caller.get("root_id") or race_id,
        parent_id=caller.get("parent_id"),
        errbacks=caller.get("errbacks") or None,
        chain=caller.get("chain") or None,
        chord=None,
        group=None,
        delivery_info={},
    )


def _short(result: dict[str, Any]) -> str:
    shown = {k: v for k, v in result.items() if k != "payload"}
    return repr(shown)[:500]


class RaceRuntime:
    """Per-process clients, config, providers and driver (built lazily, after any fork)."""

    def __init__(self) -> None:
        from .app import glue_config

        settings = glue_config().settings
        self.settings = race_settings()
        self.client = client_for(settings.redis_url)
        # Epoch time from Redis: timers, heartbeats, deadlines and the janitor agree across
        # hosts whatever their own clocks say (store/redis_clock.py).
        self.clock = RedisClock(self.client)
        self.prefix = settings.prefix
        self.config: GpuHedgeConfig = load_config(settings.config_path)
        install_redis_ledger(self.client, self.prefix)
        keeping = Keeping(self.settings.receipt_ttl_s, records_maxlen=self.settings.records_maxlen)
        # Replicas that must hold a winner claim or a reservation before it counts (Redis WAIT)
        acks = ReplicaAcks(
            settings.wait_replicas,
            settings.wait_timeout_ms,
            on_short=metrics.replica_wait_short,
        )
        # Races and their timers spread over the deployment's shards, a race's on one slot
        # the count's default follows the URL this process's client uses, as a caller's does
        shards = process_settings.current().race_shards(self.prefix, settings.redis_url)
        self.store = RaceStore(self.client, shards, keeping, clock=self.clock, acks=acks)
        self.timers = RaceTimers(self.client, shards)
        self._providers: dict[str, Provider] = {}
        self._lock = threading.Lock()
        self.effects = CeleryEffects(self.settings, shards, self.client)
        # Budgets: on when the config sets any cap (reservations and the ledger in Redis).
        self.budget = RaceBudget(
            BudgetStore(self.client, self.prefix, acks=acks), self.config.budget
        )
        parts = RaceParts(self.store, self.timers, self.provider, self.effects, self.settings)
        parts.clock, parts.budget = self.clock, self.budget
        parts.adaptive = AdaptiveStore(self.client, self.prefix)
        install_adaptive(parts.adaptive, self._rates, self.config.time_scale)
        self.driver = RaceDriver(parts)
        self.effects.driver = self.driver
        self.service: TimerServices | None = None  # this process as a timer coordinator
        self.watch_batch: WatchBatch | None = None  # the batched watch loop, once started
        self.revokes: Any = None  # the RevokeWatch thread (tasks/revokes.py), once started

    def _rates(self, policy: Policy) -> dict[str, ProviderRate]:
        """A policy's provider rates per real second, as its races are priced (race/spec.py)."""
        return build_spec(self.config, policy.name).provider_rates()

    def provider(self, name: str) -> Provider:
        """The provider called ``name`` in this process's config (built once)."""
        with self._lock:
            found = self._providers.get(name)
            if found is None:
                found = self.config.build(name, clock=self.clock)  # job times on Redis's clock
                self._providers[name] = found
            return found

    def start_timers(self) -> TimerServices:
        """Start this process's timer threads, one per race shard dealt to it (once)."""
        with self._lock:
            if self.service is None:
                self.service = TimerServices(
                    self.timers,
                    self.driver.on_timer,
                    name="gpuhedge-race-timers",
                    threads=self.settings.timer_threads,
                    ahead_ms=self.settings.timer_ahead_ms if self.settings.timer_threads > 1 else 0,
                    clock=self.clock,
                    batch_handler=self._batch_handler(),
                ).start()
            return self.service

    def start_revoke_watch(self) -> Any:
        """Start this process's watch of Celery's revoked ids, which stops revoked races
        (once)."""
        from .revokes import RevokeWatch, stop_revoked

        with self._lock:
            if self.revokes is None:
                self.revokes = RevokeWatch(lambda ids: stop_revoked(self.driver, ids)).start()
            return self.revokes

    def _batch_handler(self) -> Any:
        """The batched watch loop's handler; None with one timer thread (a batch hands back
        to the other threads what it does not step itself)."""
        if self.settings.timer_threads < 2:
            return None
        self.watch_batch = WatchBatch(self.driver)
        return self.watch_batch.handle


_runtime: dict[int, RaceRuntime] = {}
_runtime_lock = threading.Lock()


def runtime() -> RaceRuntime:
    """This process's :class:`RaceRuntime`."""
    pid = os.getpid()
    found = _runtime.get(pid)
    if found is None:
        with _runtime_lock:
            found = _runtime.get(pid)
            if found is None:
                found = RaceRuntime()
                _runtime.clear()
                _runtime[pid] = found
    return found


def current_runtime() -> RaceRuntime | None:
    """This process's runtime if one was built, without building it."""
    return _runtime.get(os.getpid())
