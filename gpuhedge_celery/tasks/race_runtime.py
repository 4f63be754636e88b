"""Per-process race runtime for the Celery glue: clients, config, providers, the driver, and
the driver's effects done the Celery way (tasks sent by name, the result backend, task events).

This module imports the Celery app only when it is used, never at import: ``tasks.app``
imports every task module (the janitor's among them, which builds on this runtime), so a
module-level import here would make ``from gpuhedge_celery import hedged_infer`` in a fresh
process import ``tasks.races`` half-way through its own import.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import lru_cache
from typing import Any

from ..config import GpuHedgeConfig, load_config
from ..errors import RaceFailed
from ..providers.base import Provider
from ..providers.redis_ledger import install_redis_ledger
from ..race.driver import RaceDriver
from ..race.settings import RaceSettings
from ..store.connection import client_for
from ..store.races import RaceStore
from ..store.timers import TimerService, TimerStore

log = logging.getLogger(__name__)

TASK_HEDGED_INFER = "gpuhedge.hedged_infer"
TASK_RACE_SUBMIT = "gpuhedge.race_submit"
TASK_RACE_CANCEL = "gpuhedge.race_cancel"
TASK_RACE_STEP = "gpuhedge.race_step"
QUEUE_ATTEMPTS = "gpuhedge.attempts"  # the same names as tasks.app (checked by the tests)


def _app() -> Any:
    from .app import app

    return app


@lru_cache(maxsize=1)
def race_settings() -> RaceSettings:
    """This process's race settings (read from the environment once)."""
    return RaceSettings.from_env()


class CeleryEffects:
    """The driver's effects as Celery does them: tasks, result backend, task events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dispatcher: Any = None

    def launch(self, race_id: str, attempt_id: str, provider: str) -> None:
        args = (race_id, attempt_id, provider)
        _app().send_task(TASK_RACE_SUBMIT, args, queue=QUEUE_ATTEMPTS)

    def cancel(self, race_id: str, attempt_id: str, provider: str) -> None:
        args = (race_id, attempt_id, provider)
        _app().send_task(TASK_RACE_CANCEL, args, queue=QUEUE_ATTEMPTS)

    def won(self, race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
        app = _app()
        if app.backend.get_task_meta(race_id).get("status") == "SUCCESS":
            return  # a resumed race re-declares its winner: links and chains must not run twice
        app.backend.mark_as_done(race_id, result)
        self.send(race_id, "task-succeeded", {"result": _short(result), "runtime": 0.0})
        _continue(race_id, result, caller)

    def failed(
        self, race_id: str, message: str, receipt: dict[str, Any], caller: dict[str, Any]
    ) -> None:
        error = RaceFailed(message, receipt)
        error.args = (message, receipt)  # Celery rebuilds exceptions as cls(*args)
        _app().backend.mark_as_failure(race_id, error)
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
                    app = _app()
                    self._dispatcher = app.events.Dispatcher(
                        app.connection_for_write(), enabled=True
                    )
                self._dispatcher.send(kind, uuid=race_id, **fields)
        except Exception:
            log.debug("race %s: event %s not sent", race_id, kind, exc_info=True)
            self._dispatcher = None


def _continue(race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
    """Do what Celery's tracer would have done on success: run links and the next chain step.

    ``hedged_infer`` ends with ``Ignore`` (its result comes later), so Celery itself does not.
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


def current_runtime() -> RaceRuntime | None:
    """This process's runtime if one was built, without building it."""
    return _runtime.get(os.getpid())
