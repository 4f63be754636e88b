"""Worker life-cycle hooks: GPU registration and heartbeat, per-process clients, start-up checks.

* ``celeryd_init`` (main process, before the banner): a worker started without ``-n`` is named
  by its role (``coord@<host>``, ``gpu0@<host>``), not ``celery@<host>``, so the roles of one
  host never share a node name (Celery's ``DuplicateNodenameWarning``, mixed-up replies).
  A coordination worker runs races from the
  YAML config (``GPUHEDGE_CONFIG``, else ./config/gpuhedge.yaml, else the packaged default), so
  it loads and validates it first; a missing explicit file, malformed YAML or an unknown key
  stops the worker with the one-line error and exit status 2, before it consumes anything.
* ``celeryd_after_setup`` (main process, before consuming): a GPU worker must run exactly one
  child, or two jobs could share the GPU and CUDA would be touched from several processes; it
  stops the same way.
* ``worker_ready`` (main process): a GPU worker registers its GPU (labels from nvidia-smi when
  it is installed, overridden by ``GPUHEDGE_GPU_LABELS``) and starts its host heartbeat; a
  coordination worker turns on keyspace notifications (one line with the fix when the server
  forbids CONFIG; waiters then run on their bounded re-check). Every worker warns when Redis
  runs without AOF: a restart would lose races and leases in flight.
  A GPU worker whose runner must load a model (or wait for its model server) marks the GPU out
  of the pool before its child is forked (``tasks/model_host.py``); with a ``server:`` runner it
  starts the model server's supervisor (``tasks/model_server.py``), and it samples its GPU's
  health from NVML (``tasks/health.py``).
* ``worker_process_init`` (each child after fork): forget Redis clients inherited from the
  parent so the child opens its own sockets; a GPU worker's child starts loading its model.
  The solo pool (``--pool solo``) sends it from the worker's own process while setting up:
  there the GPU is marked out first, the model loads in that process, and it is closed at
  ``worker_shutdown``.
* ``worker_process_shutdown`` (a child exits: recycled, or the worker stops): the GPU leaves the
  pool until the next child has loaded the model again.
* ``worker_shutdown``: stop the heartbeat and leave the pool at once on a clean stop; stop the
  model server and the health sampler.
* ``worker_shutting_down`` (SIGTERM: a warm shutdown begins): wake the worker's event loop so
  it stops at once instead of at kombu's next timer (up to 10 s on RabbitMQ).
* ``celeryd_init``, ``after_setup_logger``, ``worker_process_init``: httpx's and httpcore's
  request lines stay out of the log (they hold URLs with credentials:
  :func:`~gpuhedge_celery.secrets.quiet_http_client_logs`), whoever sets up logging.
* ``task_failure``: a task of ours that failed with an error it declares expected
  (``throws``: a caller's bad arguments to ``hedged_infer`` or ``pooled_infer``) is logged as
  one WARNING line naming the task and the error; Celery's own line for it (INFO, "raised
  expected") is dropped, and nothing logs a traceback for what the caller got as a one-line
  error.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, NoReturn, cast

from celery import signals

from ..errors import ConfigError, GpuHedgeError
from ..gpus import query_nvidia_smi
from ..names import TASK_PREFIX
from ..secrets import quiet_http_client_logs
from ..store.connection import reset_clients
from ..store.leases import GpuInfo
from .app import glue_config

log = logging.getLogger(__name__)

_host: dict[str, Any] = {}


EXIT_CONFIG = 2  # as the gpuhedge-celery command's configuration errors


def refuse_to_start(error: GpuHedgeError) -> NoReturn:
    """Stop the worker before it consumes anything: the one-line error on stderr, exit status 2.

    Raising an ordinary exception from a signal handler would not do: Celery logs it and
    carries on, and the worker would say "ready" and then fail every task.
    """
    print(f"error: {error}", file=sys.__stderr__, flush=True)
    raise SystemExit(EXIT_CONFIG)


@signals.celeryd_init.connect
def _name_by_role(sender: Any = None, instance: Any = None, **_: Any) -> None:
    from celery.utils.nodenames import default_nodename, host_format, nodesplit

    if instance is None or instance.hostname != host_format(default_nodename(None)):
        return  # named with -n
    # Nothing has used the name yet: the banner, consumer, remote control and events come later
    # (and the tracer's copy of it is set again when the worker's blueprint is built).
    instance.hostname = glue_config().default_nodename(nodesplit(instance.hostname)[1])


@signals.celeryd_init.connect
def _check_race_config(**_: Any) -> None:
    config = glue_config()
    if config.is_gpu_worker:
        return  # GPU workers run jobs from their queue; they never read the YAML config
    from ..config import load_config

    try:
        load_config(config.settings.config_path)
    except ConfigError as e:
        refuse_to_start(e)


@signals.celeryd_after_setup.connect
def _check_gpu_worker(sender: str, instance: Any, **_: Any) -> None:
    config = glue_config()
    if not config.is_gpu_worker:
        return
    _check_concurrency(instance)
    from .gpu import lease_store, runner_for
    from .model_host import mark_runner_starting

    if _host.get("solo"):
        return  # the solo pool already marked the GPU and started loading (_fresh_clients)
    # Before the pool forks its child: the GPU takes no lease until its model serves.
    gpu_id = cast(str, config.gpu_id)  # a GPU worker's is set
    mark_runner_starting(lease_store(), gpu_id, runner_for(config.pool))


def _check_concurrency(instance: Any) -> None:
    pool_name = getattr(instance.pool_cls, "__name__", str(instance.pool_cls)).lower()
    if instance.concurrency != 1 or not (
        "prefork" in pool_name or "taskpool" in pool_name or "solo" in pool_name
    ):
        refuse_to_start(
            ConfigError(
                f"a GPU worker runs one job at a time: expected --concurrency 1 with the "
                f"prefork or solo pool, got {instance.concurrency} with {pool_name}",
                key="GPUHEDGE_GPU",
            )
        )


def gpu_labels(index: str | None, configured: dict[str, str]) -> dict[str, str]:
    """Labels of this worker's GPU: what nvidia-smi says about it (model, VRAM), then config."""
    found = {}
    if index is not None and index.isdigit():
        for gpu in query_nvidia_smi():
            if gpu.index == index:
                found = dict(gpu.labels)
    return {**found, **configured}


@signals.worker_ready.connect
def _start_gpu_host(sender: Any = None, **_: Any) -> None:
    from .gpu import GpuHost, lease_store

    config = glue_config()
    store = lease_store()
    if not config.is_gpu_worker:
        try:
            from ..store.listener import enable_notifications

            enable_notifications(store.client)
        except GpuHedgeError as e:
            log.warning("keyspace notifications not enabled: %s", e)
        return
    hostname = getattr(sender, "hostname", None) or config.host
    info = GpuInfo(
        cast(str, config.gpu_id), config.pool, hostname, gpu_labels(config.gpu, config.labels)
    )
    _start_model_server(config, store)
    _start_health(config, store)
    _host["service"] = GpuHost(
        store, info, host_ttl_ms=config.host_ttl_ms, pool_ttl_ms=config.pool_ttl_ms
    ).start()


@signals.worker_ready.connect
def _warn_without_persistence(**_: Any) -> None:
    from .. import settings
    from ..store.connection import persistence_warning, replication_warning
    from .gpu import lease_store

    checks = (
        lambda client: persistence_warning(client),
        lambda client: replication_warning(client, settings.current().core.wait_replicas),
    )
    for check in checks:  # each on its own: one failing hides nothing of the other
        try:
            warning = check(lease_store().client)
        except Exception as e:  # a warning must never stop a worker
            log.debug("Redis set-up check failed: %s", e)
            continue
        if warning:
            log.warning("%s", warning)


def _start_model_server(config: Any, store: Any) -> None:
    from ..server_runner import ServerRunner
    from .gpu import runner_for
    from .model_server import ServerSupervisor

    runner = runner_for(config.pool)
    if isinstance(runner, ServerRunner):
        _host["server"] = ServerSupervisor(
            runner,
            config.server_cmd,
            store,
            config.gpu_id,
            retry_s=config.runner_retry_s,
            retry_max_s=config.runner_retry_max_s,
        ).start()


def _start_health(config: Any, store: Any) -> None:
    from .health import start_health_monitor

    monitor = start_health_monitor(config, store)
    if monitor is not None:
        _host["health"] = monitor


@signals.worker_shutdown.connect
def _stop_gpu_host(**_: Any) -> None:
    for name in ("health", "server", "service"):
        service = _host.pop(name, None)
        if service is not None:
            service.stop()
    if _host.pop("solo", False):
        from .model_host import stop_child_runner

        stop_child_runner("worker stopped: its model loads again when it starts")


@signals.celeryd_init.connect
def _remember_main_process(**_: Any) -> None:
    _host["main_pid"] = os.getpid()


@signals.worker_process_init.connect
def _fresh_clients(**_: Any) -> None:
    reset_clients()
    config = glue_config()
    if config.is_gpu_worker:
        from .gpu import lease_store, runner_for
        from .model_host import mark_runner_starting, start_child_runner

        runner = runner_for(config.pool)
        if os.getpid() == _host.get("main_pid"):
            # The solo pool: no child, this signal comes from the worker's own process while
            # it is being set up, so the GPU is marked out here, before the load starts, and
            # the model is closed at worker_shutdown (_stop_gpu_host).
            _host["solo"] = True
            mark_runner_starting(lease_store(), cast(str, config.gpu_id), runner)
        start_child_runner(lease_store(), cast(str, config.gpu_id), runner, config)


@signals.worker_process_shutdown.connect
def _child_exits(**_: Any) -> None:
    from .model_host import stop_child_runner

    stop_child_runner()


# -- a warm shutdown noticed at once ---------------------------------------------------------
_loop: dict[str, Any] = {}


@signals.worker_ready.connect
def _keep_event_loop(sender: Any = None, **_: Any) -> None:
    """Remember the worker's event loop (kombu's hub; None for a pool without one)."""
    _loop["hub"] = getattr(sender, "hub", None)


@signals.worker_shutting_down.connect
def _wake_event_loop(**_: Any) -> None:
    """Wake the worker's event loop so it sees the warm shutdown now.

    Celery's SIGTERM handler only sets a flag, which the worker reads when its event loop next
    wakes. With RabbitMQ and no message coming, kombu sleeps until its next timer, up to 10 s:
    a worker took 8 s to stop (Redis's transport wakes the loop every second). The flag is set
    after this signal returns, so a helper thread wakes the loop a moment later (a wake-up from
    another thread is the hub's own ``call_soon``), and once more in case that was too early.
    """
    hub = _loop.get("hub")
    if hub is None:
        return

    def wake() -> None:
        for delay in (0.05, 0.5):
            time.sleep(delay)
            try:
                hub.call_soon(_nothing)
            except Exception:  # the loop is already gone: nothing to wake
                return

    threading.Thread(target=wake, name="gpuhedge-shutdown-wake", daemon=True).start()


def _nothing() -> None:
    return None


# -- a caller's bad arguments: one WARNING line, no traceback ---------------------------------


def _ours(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(TASK_PREFIX)


class ExpectedFailureFilter(logging.Filter):
    """Drops Celery's "raised expected" line for our tasks: :func:`_log_refused` says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if not isinstance(data, dict):
            return True
        return not (data.get("description") == "raised expected" and _ours(data.get("name")))


logging.getLogger("celery.app.trace").addFilter(ExpectedFailureFilter())


@signals.celeryd_init.connect
def _warn_retired(**_: Any) -> None:
    from ..envvars import retired_set

    for line in retired_set(os.environ):
        log.warning("%s", line)


@signals.celeryd_init.connect
@signals.after_setup_logger.connect  # sent only when no app has its own setup_logging
@signals.worker_process_init.connect
def _quiet_http_clients(**_: Any) -> None:
    quiet_http_client_logs()


@signals.task_failure.connect
def _log_refused(sender: Any = None, task_id: Any = None, exception: Any = None, **_: Any) -> None:
    throws = getattr(sender, "throws", None) or ()
    if _ours(getattr(sender, "name", None)) and isinstance(exception, throws):
        log.warning("%s[%s] refused: %s", sender.name, task_id, exception)
