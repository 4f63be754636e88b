"""Worker hooks for the Prometheus endpoint (``GPUHEDGE_METRICS_PORT``; docs/metrics.md).

* ``celeryd_init`` (main process, before the pool forks): serve ``/metrics``, in multiprocess
  mode when the worker's pool forks (``-P`` or the app's ``worker_pool``); a bad or taken
  port, or a missing ``prometheus_client``, stops the worker with the one-line error and exit
  status 2.
* ``worker_process_init`` (each prefork child): close the inherited listening socket.
* ``worker_shutdown``: stop serving (and remove a temporary multiprocess directory).
"""

from __future__ import annotations

from typing import Any

from celery import signals

from ..errors import ConfigError
from ..metrics.exposition import pool_forks, start_worker_endpoint
from .signals import refuse_to_start

_endpoint: dict[str, Any] = {}


@signals.celeryd_init.connect
def _serve_metrics(conf: Any = None, options: Any = None, **_: Any) -> None:
    pool = (options or {}).get("pool_cls") or getattr(conf, "worker_pool", None) or "prefork"
    try:
        endpoint = start_worker_endpoint(forks=pool_forks(pool))
    except ConfigError as e:
        refuse_to_start(e)
    if endpoint is not None:
        _endpoint["it"] = endpoint


@signals.worker_process_init.connect
def _child_forgets_endpoint(**_: Any) -> None:
    endpoint = _endpoint.get("it")
    if endpoint is not None:
        endpoint.after_fork()


@signals.worker_shutdown.connect
def _stop_metrics(**_: Any) -> None:
    endpoint = _endpoint.pop("it", None)
    if endpoint is not None:
        endpoint.close()
