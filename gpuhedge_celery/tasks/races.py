"""Celery glue for hedged races: ``hedged_infer``, the attempt tasks, the step task, timers.

A race costs no process and no thread while it waits: it is state in Redis (see
:mod:`gpuhedge_celery.race.driver`), advanced by short tasks and by durable timers that a
:class:`~gpuhedge_celery.store.timers.TimerService` thread fires in every coordination worker.

* ``gpuhedge.hedged_infer`` (queue ``gpuhedge.coord``): validates its arguments (one-line
  ``ConfigError``), creates the race under race id = the task id (a redelivery resumes it),
  performs the engine's first actions (submitting the primary itself unless
  ``GPUHEDGE_SUBMIT_PRIMARY_INLINE=0``) and raises ``Ignore``: Celery stores nothing. The driver
  later marks the task id done the moment a winner is declared (``.get()`` returns then, before
  losers are cleaned up) or failed with :class:`~gpuhedge_celery.errors.RaceFailed` carrying
  the receipt.
* ``gpuhedge.race_submit`` / ``gpuhedge.race_cancel`` (queue ``gpuhedge.attempts``): submit one
  attempt's job (registered in the live-job index before it is reported; never re-submitted on
  redelivery), or cancel it through the provider's native API. Arguments name race, attempt and
  provider, so Flower's task list shows who is doing what.
* ``gpuhedge.race_step`` (queue ``gpuhedge.coord``): apply one serialised engine event.

All tasks are ``acks_late`` + ``reject_on_worker_lost``: a killed worker's message is
redelivered, and every task is idempotent.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import lru_cache
from typing import Any

from celery import Task, signals
from celery.exceptions import Ignore

from ..config import GpuHedgeConfig, load_config
from ..core.race_events import event_from_dict
from ..errors import ConfigError, RaceFailed, StoreError
from ..providers.base import Provider
from ..providers.redis_ledger import install_redis_ledger
from ..race.driver import RaceDriver
from ..race.settings import RaceSettings
from ..race.spec import build_spec, check_request
from ..store.connection import client_for
from ..store.races import RaceStore
from ..store.timers import TimerService, TimerStore
from .app import QUEUE_ATTEMPTS, QUEUE_COORD, app, glue_config
from .pool import celery_safe

log = logging.getLogger(__name__)

TASK_HEDGED_INFER = "gpuhedge.hedged_infer"
TASK_RACE_SUBMIT = "gpuhedge.race_submit"
TASK_RACE_CANCEL = "gpuhedge.race_cancel"
TASK_RACE_STEP = "gpuhedge.race_step"


@lru_cache(maxsize=1)
def race_settings() -> RaceSettings:
    """This process's race settings (read from the environment once)."""
    return RaceSettings.from_env()


app.conf.update(race_settings().as_celery_conf())
app.conf.task_routes = {
    **(app.conf.task_routes or {}),
    TASK_HEDGED_INFER: {"queue": QUEUE_COORD},
    TASK_RACE_STEP: {"queue": QUEUE_COORD},
    TASK_RACE_SUBMIT: {"queue": QUEUE_ATTEMPTS},
    TASK_RACE_CANCEL: {"queue": QUEUE_ATTEMPTS},
}
race_settings().import_plugins()


class CeleryEffects:
    """The driver's effects as Celery does them: tasks, result backend, task events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dispatcher: Any = None

    def launch(self, race_id: str, attempt_id: str, provider: str) -> None:
        race_submit.apply_async((race_id, attempt_id, provider), queue=QUEUE_ATTEMPTS)

    def cancel(self, race_id: str, attempt_id: str, provider: str) -> None:
        race_cancel.apply_async((race_id, attempt_id, provider), queue=QUEUE_ATTEMPTS)

    def won(self, race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
        app.backend.mark_as_done(race_id, result)
        self.send(race_id, "task-succeeded", {"result": _short(result), "runtime": 0.0})
        _continue(race_id, result, caller)

    def failed(
        self, race_id: str, message: str, receipt: dict[str, Any], caller: dict[str, Any]
    ) -> None:
        error = RaceFailed(message, receipt)
        error.args = (message, receipt)  # Celery rebuilds exceptions as cls(*args)
        app.backend.mark_as_failure(race_id, error)
        self.send(race_id, "task-failed", {"exception": message, "traceback": ""})

    def event(self, race_id: str, name: str, fields: dict[str, Any]) -> None:
        self.send(race_id, f"task-{name}", fields)

    def send(self, race_id: str, kind: str, fields: dict[str, Any]) -> None:
        """Publish one task event for Flower / ``celery events``; failures are only logged."""
        if not race_settings().events:
            return
        try:
            with self._lock:
                if self._dispatcher is None:
                    self._dispatcher = app.events.Dispatcher(
                        app.connection_for_write(), enabled=True
                    )
                self._dispatcher.send(kind, uuid=race_id, **fields)
        except Exception:
            log.debug("race %s: event %s not sent", race_id, kind, exc_info=True)
            self._dispatcher = None


def _caller(task: Task) -> dict[str, Any]:
    """What the task's own message asked to happen after it (links, the rest of a chain)."""
    request = task.request
    return {
        "callbacks": list(request.callbacks or []),
        "chain": list(request.chain or []),
        "root_id": request.root_id,
    }


def _continue(race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
    """Do what Celery's tracer would have done on success: run links and the next chain step.

    ``hedged_infer`` ends with ``Ignore`` (its result comes later), so Celery itself does not.
    """
    from celery import signature

    options = {"parent_id": race_id, "root_id": caller.get("root_id") or race_id}
    for callback in caller.get("callbacks") or []:
        signature(callback, app=app).apply_async((result,), **options)
    chain = list(caller.get("chain") or [])
    if chain:
        following = signature(chain.pop(), app=app)
        following.apply_async((result,), chain=chain or None, **options)


def _short(result: dict[str, Any]) -> str:
    shown = {k: v for k, v in result.items() if k != "payload"}
    return repr(shown)[:500]


class RaceRuntime:
    """Per-process clients, config, providers and driver (built lazily, after any fork)."""

    def __init__(self) -> None:
        settings = glue_config().settings
        self.settings = race_settings()
        self.client = client_for(settings.redis_url)
        self.prefix = settings.prefix
        self.config: GpuHedgeConfig = load_config(settings.config_path)
        install_redis_ledger(self.client, self.prefix)
        self.store = RaceStore(self.client, self.prefix, receipt_ttl_s=self.settings.receipt_ttl_s)
        self.timers = TimerStore(self.client, self.prefix, self.settings.timer_namespace)
        self._providers: dict[str, Provider] = {}
        self._lock = threading.Lock()
        self.driver = RaceDriver(
            self.store, self.timers, self.provider, CeleryEffects(), self.settings
        )
        self.service: TimerService | None = None

    def provider(self, name: str) -> Provider:
        """The provider called ``name`` in this process's config (built once)."""
        with self._lock:
            found = self._providers.get(name)
            if found is None:
                found = self.config.build(name)
                self._providers[name] = found
            return found

    def start_timers(self) -> TimerService:
        """Start this process's timer thread (once)."""
        with self._lock:
            if self.service is None:
                self.service = TimerService(
                    self.timers, self.driver.on_timer, name="gpuhedge-race-timers"
                ).start()
            return self.service


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


@app.task(bind=True, name=TASK_HEDGED_INFER, **_TASK_OPTIONS)
def hedged_infer(
    self: Task,
    request: Any,
    policy: Any = None,
    providers: Any = None,
    validator: Any = None,
) -> Any:
    """Race ``request`` across providers; ``.get()`` returns the first valid result.

    ``policy``: None (config), ``single``/``fixed``/``state_aware``/``cascade`` or a spec like
    ``hedge:P->H@10s``; ``providers``: names for the roles; ``validator``: a name or
    ``{"name": ..., **options}``. Bad input fails at once with a one-line ConfigError.
    """
    race_id = self.request.id
    try:
        if not race_id or self.request.is_eager:
            raise ConfigError(
                "hedged_infer runs on workers: use .delay(), .apply_async() or send_task()"
            )
        rt = runtime()
        check_request(request)
        spec = build_spec(rt.config, policy, providers, validator)
    except ConfigError as e:
        raise celery_safe(e) from None
    inline = rt.settings.submit_primary_inline
    rt.driver.create(race_id, request, spec, _caller(self), submit_first=inline)
    raise Ignore()  # the result is stored by whichever process declares the winner


@app.task(name=TASK_RACE_SUBMIT, **_TASK_OPTIONS, **_RETRY_STORE)
def race_submit(race_id: str, attempt_id: str, provider: str) -> None:
    """Submit one attempt's job to ``provider`` (idempotent) and start watching it."""
    runtime().driver.submit_attempt(race_id, attempt_id)


@app.task(name=TASK_RACE_CANCEL, **_TASK_OPTIONS, **_RETRY_STORE)
def race_cancel(race_id: str, attempt_id: str, provider: str) -> None:
    """Cancel one attempt's job through ``provider``'s native cancel and report the receipt."""
    runtime().driver.cancel_attempt(race_id, attempt_id)


@app.task(name=TASK_RACE_STEP, **_TASK_OPTIONS, **_RETRY_STORE)
def race_step(race_id: str, event: dict[str, Any]) -> None:
    """Apply one engine event (``Event.to_dict()`` form) to a race."""
    runtime().driver.step(race_id, event_from_dict(event))


@signals.worker_ready.connect
def _start_race_timers(sender: Any = None, **_: Any) -> None:
    if glue_config().is_gpu_worker:
        return
    try:
        runtime().start_timers()
    except Exception as e:  # a worker without timers still serves tasks; say why loudly
        log.error("race timers not started in this worker: %s", e)


@signals.worker_shutdown.connect
def _stop_race_timers(**_: Any) -> None:
    rt = _runtime.get(os.getpid())
    if rt is not None and rt.service is not None:
        rt.service.stop()
