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
from typing import Any

from celery import Task, signals
from celery.exceptions import Ignore

from ..core.race_events import event_from_dict
from ..errors import ConfigError, StoreError
from ..race.spec import build_spec, check_request
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

# isort: split
# Bound above before tasks.app runs: it imports every task module, and the janitor's builds on
# CeleryEffects/runtime from here, so these names must exist when it does.
from .app import QUEUE_ATTEMPTS, QUEUE_COORD, app, glue_config
from .pool import celery_safe

log = logging.getLogger(__name__)

__all__ = [
    "TASK_HEDGED_INFER",
    "TASK_RACE_CANCEL",
    "TASK_RACE_STEP",
    "TASK_RACE_SUBMIT",
    "CeleryEffects",
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


def _caller(task: Task) -> dict[str, Any]:
    """What the task's own message asked to happen after it (links, the rest of a chain)."""
    request = task.request
    return {
        "callbacks": list(request.callbacks or []),
        "chain": list(request.chain or []),
        "root_id": request.root_id,
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
    rt = current_runtime()
    if rt is not None and rt.service is not None:
        rt.service.stop()
