"""A caller's request stays out of task events, message headers and ``inspect``: its size goes in.

Celery puts a ``repr`` of every task's arguments in the message headers (``argsrepr``) and in
the ``task-received`` event a worker sends (Flower shows it, to anyone who reaches Flower). A
request may hold anything a user sent (a name, a document, an ID number), so for the tasks that
carry one (``hedged_infer``, ``pooled_infer``, ``gpu_run``) these show ``<request: N bytes>``
instead:

* ``before_task_publish`` (the sending process: a client, a worker dispatching to a GPU)
  rewrites the headers before the message leaves;
* ``task_received`` (the worker, before its ``task-received`` event) does the same for a
  message a foreign app sent by name with Celery's default ``argsrepr`` (in the headers the
  worker hands its pool too, which a ``-l DEBUG`` worker logs);
* :class:`RedactedRequest`, these tasks' request class, answers ``inspect active`` /
  ``reserved`` (Flower's worker page) with the same summaries instead of the raw arguments.

* :class:`RedactingAMQP`, this app's message factory, writes the summaries into a message as
  it is made, so Celery's ``task-sent`` event (off unless ``task_send_sent_event`` is set;
  built with the message, before the publish signal) carries them too.

A message a worker refuses (unsigned where signing is on, unregistered, malformed) is logged by
Celery with its body and headers: :class:`RefusedMessageFilter` logs their size instead.

``GPUHEDGE_EVENTS_SHOW_REQUEST=1`` keeps Celery's own reprs (a trusted, private Flower).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from celery import signals
from celery.app.amqp import AMQP
from celery.worker.request import Request

from ..race.spec import request_summary
from .app import TASK_GPU_RUN, TASK_POOLED_INFER
from .race_runtime import TASK_HEDGED_INFER, race_settings

REQUEST_TASKS = frozenset({TASK_HEDGED_INFER, TASK_POOLED_INFER, TASK_GPU_RUN})


def summarised_args(args: Any) -> str:
    """``argsrepr`` for a task whose first argument is the request."""
    args = tuple(args or ())
    if not args:
        return "()"
    rest = "".join(f", {a!r}"[:200] for a in args[1:])
    return f"({request_summary(args[0])}{rest})"


def summarised_kwargs(kwargs: Any) -> str:
    """``kwargsrepr`` with a ``request`` keyword argument summarised, the rest shown."""
    shown = {k: (request_summary(v) if k == "request" else v) for k, v in (kwargs or {}).items()}
    return repr(shown)[:1000]


def _redacting() -> bool:
    try:
        return not race_settings().events_show_request
    except Exception:  # a settings error must not publish a request in the clear
        return True


ARGSREPR_POSITION = 21  # as_task_v2's positional parameters after ``kwargs``, up to argsrepr


class RedactingAMQP(AMQP):
    """The app's message factory: a request-carrying task's ``argsrepr`` and ``kwargsrepr`` are
    its summaries from the start, in the headers and in the ``task-sent`` event alike."""

    def as_task_v2(
        self,
        task_id: Any,
        name: Any,
        args: Any = None,
        kwargs: Any = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        positional = len(more) > ARGSREPR_POSITION  # a caller that passed argsrepr itself
        if name in REQUEST_TASKS and not positional and options.get("argsrepr") is None:
            if _redacting():
                try:
                    options["argsrepr"] = summarised_args(args)
                    options["kwargsrepr"] = summarised_kwargs(kwargs)
                except Exception:  # never the request in the clear
                    options["argsrepr"] = options["kwargsrepr"] = "<redacted>"
        return super().as_task_v2(task_id, name, args, kwargs, *more, **options)


class RedactedRequest(Request):
    """The worker's request for a task that carries a caller's request: ``inspect`` shows
    summaries, never the arguments themselves."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        found = super().info(safe=safe)
        if _redacting():
            found["args"], found["kwargs"] = self._argsrepr, self._kwargsrepr
        return found


# Celery's consumer writes a message's body as "<repr> (<size>b)" (celery's dump_body)
_BODY_DUMP = re.compile(r"\((\d+)b\)")
CONSUMER_LOGGER = "celery.worker.consumer.consumer"


class RefusedMessageFilter(logging.Filter):
    """The body and headers of a message the worker refused, as their size: the message may
    carry a caller's request (an unsigned client's task, a task of another app's version)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args and _redacting():
            record.args = tuple(_hidden(a) for a in record.args)
        return True


def _hidden(arg: Any) -> Any:
    if isinstance(arg, dict) and "argsrepr" in arg:  # the headers: what names the message
        return {k: arg[k] for k in ("id", "task") if k in arg}
    if isinstance(arg, str):
        found = _BODY_DUMP.search(arg)
        if found:
            return f"<message body of {found.group(1)} bytes, not shown>"
        if "argsrepr" in arg:
            return "<message headers, not shown>"
    return arg


logging.getLogger(CONSUMER_LOGGER).addFilter(RefusedMessageFilter())


@signals.before_task_publish.connect
def _redact_published(sender: Any = None, body: Any = None, headers: Any = None, **_: Any) -> None:
    if sender not in REQUEST_TASKS or not isinstance(headers, dict) or not _redacting():
        return
    if isinstance(body, (tuple, list)) and len(body) >= 2:  # task protocol 2: (args, kwargs, ..)
        try:
            headers["argsrepr"] = summarised_args(body[0])
            headers["kwargsrepr"] = summarised_kwargs(body[1])
        except Exception:  # never the request in the clear
            headers["argsrepr"] = headers["kwargsrepr"] = "<redacted>"


@signals.task_received.connect
def _redact_received(request: Any = None, **_: Any) -> None:
    if getattr(request, "name", None) not in REQUEST_TASKS or not _redacting():
        return
    try:
        request._argsrepr = summarised_args(request.args)  # noqa: SLF001 - read by its event next
        request._kwargsrepr = summarised_kwargs(request.kwargs)  # noqa: SLF001
    except Exception:  # never the request in the clear
        request._argsrepr = request._kwargsrepr = "<redacted>"  # noqa: SLF001
    # the headers go to the pool as they came: its DEBUG line ("TaskPool: Apply") prints them
    headers = getattr(request, "_request_dict", None)
    if isinstance(headers, dict):
        headers["argsrepr"] = request._argsrepr  # noqa: SLF001
        headers["kwargsrepr"] = request._kwargsrepr  # noqa: SLF001
