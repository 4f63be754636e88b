"""Celery glue for hedged races: ``hedged_infer``, the attempt tasks, the step task, timers.

A race costs no process and no thread while it waits: it is state in Redis (see
:mod:`gpuhedge_celery.race.driver`), advanced by short tasks and by durable timers that a
:class:`~gpuhedge_celery.store.timer_service.TimerService` thread fires in every coordination
worker.

* ``gpuhedge.hedged_infer`` (queue ``gpuhedge.coord``): validates its arguments (one-line
  ``ConfigError``), creates the race under race id = the task id (a redelivery resumes it),
  performs the engine's first actions (submitting the primary itself, no task hop before it
  runs) and returns a marker Celery does not store (see
  :class:`RaceTask`). The driver
  later marks the task id done the moment a winner is declared (``.get()`` returns then, before
  losers are cleaned up) or failed with :class:`~gpuhedge_celery.errors.RaceFailed` carrying
  the receipt.
* ``gpuhedge.race_submit`` / ``gpuhedge.race_cancel`` (queue ``gpuhedge.attempts``): submit one
  attempt's job (registered in the live-job index before it is reported; never re-submitted on
  redelivery), or cancel it through the provider's native API (races cancel their losers on the
  deciding process's cancel threads, with a durable backstop timer; the task is for operators).
  Arguments name race, attempt and provider, so Flower's task list shows who is doing what.
* ``gpuhedge.race_step`` (queue ``gpuhedge.coord``): apply one serialised engine event; a stop
  (``StopRequested``, sent by ``cancel_race`` / ``RaceResult.stop()`` / ``gpuhedge-celery
  cancel``: ``tasks/stop.py``) enters a race this way. ``revoke()`` on a ``hedged_infer``
  result stops its race too (``tasks/revokes.py``).

All tasks are ``acks_late`` + ``reject_on_worker_lost``: a killed worker's message is
redelivered, and every task is idempotent.
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Any

from celery import Task, signals
from celery.utils.saferepr import saferepr
from celery.worker import state as worker_state

from ..core.race_events import StopRequested, event_from_dict
from ..errors import ConfigError, GpuHedgeError, StoreError
from ..race.spec import build_spec, check_options, check_request
from ..store.outage import through_outage
from .app import QUEUE_ATTEMPTS, QUEUE_COORD, REDACTED_REQUEST, app, glue_config
from .pool import celery_safe
from .race_runtime import (  # the runtime's names are re-exported: see __all__
    TASK_HEDGED_INFER,
    TASK_RACE_CANCEL,
    TASK_RACE_STEP,
    TASK_RACE_SUBMIT,
    CeleryEffects,
    RaceRuntime,
    current_runtime,
    race_settings,
    runtime,
)
from .redaction import summarised_args
from .result import RaceResult
from .revokes import BY as REVOKED_BY
from .sending import broker_errors

log = logging.getLogger(__name__)

__all__ = [
    "TASK_HEDGED_INFER",
    "TASK_RACE_CANCEL",
    "TASK_RACE_STEP",
    "TASK_RACE_SUBMIT",
    "CeleryEffects",
    "RaceResult",
    "RaceRuntime",
    "hedged_infer",
    "race_cancel",
    "race_settings",
    "race_step",
    "race_submit",
    "runtime",
]


app.conf.update(race_settings().as_celery_conf())
app.conf.task_routes = {
    **(app.conf.task_routes or {}),
    TASK_HEDGED_INFER: {"queue": QUEUE_COORD},
    TASK_RACE_STEP: {"queue": QUEUE_COORD},
    TASK_RACE_SUBMIT: {"queue": QUEUE_ATTEMPTS},
    TASK_RACE_CANCEL: {"queue": QUEUE_ATTEMPTS},
}
race_settings().import_plugins()


_NAMED = frozenset({"request", "policy", "providers", "validator"})  # hedged_infer's own


class RaceStarted(str):
    """What ``hedged_infer``'s body returns: a marker that its real result comes later."""

    __slots__ = ()


class _DeferringBackend:
    """The app's result backend, except that a :class:`RaceStarted` return is not stored."""

    __slots__ = ("_backend",)

    def __init__(self, backend: Any):
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def mark_as_done(self, task_id: str, result: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(result, RaceStarted):
            return None  # the driver marks the winner's result under this id later
        return self._backend.mark_as_done(task_id, result, *args, **kwargs)


class RaceTask(Task):
    """``hedged_infer``'s task class: the body starts a race and returns without a result.

    Celery's way to say "the result comes later" is to raise ``Ignore``, but its tracer then
    formats a traceback (two of them, over its own very large frame), the biggest single cost
    of starting a race (docs/benchmarks.md). Instead the body returns a
    :class:`RaceStarted` marker that the backend wrapper does not store, clears the links and
    chain it passes on to the winner itself, and the worker's own task events are off for
    this task: the race sends ``task-received``/``task-started`` itself, so Flower never sees
    a premature ``SUCCESS``.
    """

    send_events = False

    def AsyncResult(self, task_id: str, **kwargs: Any) -> RaceResult:  # noqa: N802 - Celery's
        """What ``delay``/``apply_async`` return: ``.get()`` never waits past the race's
        deadline, nor for a result whose message was lost (``tasks/result.py``)."""
        kwargs.setdefault("backend", self.app.backend)
        return RaceResult(task_id, task_name=self.name, app=self.app, **kwargs)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """Celery's, after the request's own check (a JSON object within
        ``GPUHEDGE_REQUEST_MAX_BYTES``: refused here, before it crosses the broker; the worker
        checks again), with an unreachable broker as ``StoreUnavailable``."""
        if args:
            check_request(tuple(args)[0], race_settings().request_max_bytes)
        elif kwargs and "request" in kwargs:
            check_request(kwargs["request"], race_settings().request_max_bytes)
        # a misspelt keyword is refused here, as Celery refuses one its signature lacks
        check_options("hedged_infer", {k: v for k, v in (kwargs or {}).items() if k not in _NAMED})
        with broker_errors(self.app):
            return super().apply_async(args, kwargs, task_id=task_id, **options)

    @property
    def backend(self) -> Any:
        return _DeferringBackend(self.app.backend)

    @backend.setter
    def backend(self, value: Any) -> None:  # Celery assigns None at registration
        if value is not None:
            raise AttributeError("hedged_infer always uses the app's result backend")


def _caller(task: Task) -> dict[str, Any]:
    """What the task's own message asked to happen after it (links, the rest of a chain)."""
    request = task.request
    return {
        "callbacks": list(request.callbacks or []),
        "errbacks": list(request.errbacks or []),
        "chain": list(request.chain or []),
        "root_id": request.root_id,
        "parent_id": request.parent_id,
    }


_TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "acks_on_failure_or_timeout": True,
}
_RETRY_STORE: dict[str, Any] = {
    "autoretry_for": (StoreError,),
    "retry_backoff": 0.2,
    "retry_backoff_max": 5,
    "max_retries": 20,
}


# a caller's bad arguments: one WARNING line on the worker, no traceback (tasks/signals.py)
@app.task(
    bind=True,
    base=RaceTask,
    name=TASK_HEDGED_INFER,
    throws=(ConfigError,),
    Request=REDACTED_REQUEST,
    **_TASK_OPTIONS,
)
def hedged_infer(
    self: Task,
    request: Any,
    policy: Any = None,
    providers: Any = None,
    validator: Any = None,
    **keywords: Any,
) -> Any:
    """Race ``request`` across providers; ``.get()`` returns the first valid result.

    ``policy``: None (config), ``single``/``fixed``/``state_aware``/``cascade`` or a spec like
    ``hedge:P->H@10s``; ``providers``: names for the roles; ``validator``: a name or
    ``{"name": ..., **options}`` (under the config's ``hmac``, a check added after the
    signature's, never a replacement). By keyword only: ``budget_key``: whose budget it spends
    (``budget.keys``); ``arm``: the experiment arm it runs in (its race record carries it).
    Bad input fails at once with a one-line ConfigError. A race whose primary the budget
    refuses raises :class:`~gpuhedge_celery.errors.BudgetExceeded` (a ``RaceFailed``).
    """
    check_options("hedged_infer", keywords)  # a message sent by name is not checked before
    race_id = self.request.id
    rt = None
    try:
        if not race_id or self.request.is_eager:
            raise ConfigError(
                "hedged_infer runs on workers: use .delay(), .apply_async() or send_task()"
            )
        rt = _worker_runtime()
        _announce(rt, self, request, policy, providers, validator)
        check_request(request, rt.settings.request_max_bytes)
        spec = build_spec(rt.config, policy, providers, validator, **keywords)
    except ConfigError as e:
        if rt is not None:
            rt.effects.send(race_id, "task-failed", {"exception": str(e), "traceback": ""})
        raise celery_safe(e) from None
    caller = _caller(self)
    # Creating is idempotent (a second create resumes the race it finds), so a Redis blip waits
    # here rather than failing the caller's .get() with StoreUnavailable while the race may run.
    through_outage(
        rt.driver.store.client,
        f"race {race_id}: start it",
        lambda: rt.driver.create(race_id, request, spec, caller, submit_first=True),
    )
    if race_id in worker_state.revoked:  # revoked while it was being created: stop it now
        rt.driver.step(race_id, StopRequested(REVOKED_BY))
    # The race runs the links and the rest of the chain with the winner's result, or the
    # error links and the chain's failure when it has none (see CeleryEffects.won/failed);
    # Celery's tracer must not run them now with the marker. (If create raised, it still does
    # what Celery does for any failed task: error links, chain marked failed.)
    self.request.callbacks = None
    self.request.errbacks = None
    self.request.chain = None
    return RaceStarted("race started; the winner's result is stored under this id later")


def _worker_runtime() -> RaceRuntime:
    """This worker's race runtime. Its own bad config is the operator's to fix, not the
    caller's: not a ConfigError (which ``throws`` logs as a caller's mistake, one WARNING line)
    but an error logged with its traceback."""
    try:
        return runtime()
    except ConfigError as e:
        raise GpuHedgeError(f"this worker's configuration is broken: {e}") from e


def _announce(rt: RaceRuntime, task: Task, *args: Any) -> None:
    """Celery's ``task-received``/``task-started`` for Flower (the worker's are off here)."""
    request = task.request
    rt.effects.hostname = rt.effects.hostname or request.hostname
    shown = saferepr(args[:1]) if rt.settings.events_show_request else summarised_args(args[:1])
    fields = {
        "name": TASK_HEDGED_INFER,
        "args": shown,
        "kwargs": saferepr(dict(zip(("policy", "providers", "validator"), args[1:], strict=True))),
        "root_id": request.root_id,
        "parent_id": request.parent_id,
        "retries": request.retries or 0,
        "eta": request.eta,
        "expires": request.expires,
    }
    rt.effects.send(request.id, "task-received", fields)
    rt.effects.send(request.id, "task-started", {})


@app.task(name=TASK_RACE_SUBMIT, **_TASK_OPTIONS, **_RETRY_STORE)
def race_submit(race_id: str, attempt_id: str, provider: str) -> None:
    """Submit one attempt's job to ``provider`` (idempotent) and start watching it."""
    runtime().driver.submit_attempt(race_id, attempt_id)


@app.task(name=TASK_RACE_CANCEL, **_TASK_OPTIONS, **_RETRY_STORE)
def race_cancel(race_id: str, attempt_id: str, provider: str) -> None:
    """Cancel one attempt's job through ``provider``'s native cancel and report the receipt.

    Races cancel their losers on the deciding process's cancel threads (no hop); this task is
    the same idempotent work for operators and other apps (``send_task`` by name).
    """
    runtime().driver.cancel_attempt(race_id, attempt_id)


MESSAGE_EVENTS = frozenset({StopRequested.kind})  # what race_step accepts from the broker


@app.task(name=TASK_RACE_STEP, throws=(ConfigError,), **_TASK_OPTIONS, **_RETRY_STORE)
def race_step(race_id: str, event: dict[str, Any]) -> None:
    """Apply one engine event (``Event.to_dict()`` form) to a race: only an event a caller may
    send (a stop). What a provider says of its job (a result, a status, a cancel's outcome) is
    learnt from the provider by the workers themselves, never taken from a message."""
    kind = event.get("kind") if isinstance(event, dict) else None
    if kind not in MESSAGE_EVENTS:
        raise ConfigError(
            f"race_step takes only {', '.join(sorted(MESSAGE_EVENTS))} from a message, got "
            f"{str(kind)[:40]!r}: a provider's facts come from the provider",
            key="event",
        )
    _worker_runtime().driver.step(race_id, event_from_dict(event))


@signals.worker_ready.connect
def _start_race_timers(sender: Any = None, **_: Any) -> None:
    if glue_config().is_gpu_worker:
        return
    try:
        # events are sent as this worker (Flower's workers tab), not as a generated name
        runtime().effects.hostname = getattr(sender, "hostname", None)
        interval = race_settings().switch_interval_ms
        if interval > 0:
            # a thread back from a Redis reply waits for the GIL up to the switch interval
            sys.setswitchinterval(interval / 1000.0)
        # Everything loaded so far (Celery, kombu, the config) lives as long as the worker:
        # keep it out of the collector's full passes, which otherwise pause every thread.
        gc.freeze()
        runtime().start_timers()
        runtime().start_revoke_watch()  # AsyncResult.revoke() stops a race (tasks/revokes.py)
    except Exception as e:  # a worker without timers still serves tasks; say why loudly
        log.error("race timers not started in this worker: %s", e)


@signals.worker_shutdown.connect
def _stop_race_timers(**_: Any) -> None:
    rt = current_runtime()
    if rt is not None and rt.service is not None:
        rt.service.stop()
    if rt is not None and rt.revokes is not None:
        rt.revokes.stop()
    if rt is not None:
        rt.effects.close()
