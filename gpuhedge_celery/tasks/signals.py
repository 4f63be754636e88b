"""Worker life-cycle hooks: GPU registration and heartbeat, per-process clients, start-up checks.

* ``celeryd_after_setup`` (main process, before consuming): a GPU worker must run exactly one
  child, or two jobs could share the GPU and CUDA would be touched from several processes.
* ``worker_ready`` (main process): a GPU worker registers its GPU (labels from nvidia-smi when
  it is installed, overridden by ``GPUHEDGE_GPU_LABELS``) and starts its host heartbeat; a
  coordination worker turns on keyspace notifications (one line with the fix when the server
  forbids CONFIG; waiters then run on their bounded re-check).
* ``worker_process_init`` (each child after fork): forget Redis clients inherited from the
  parent so the child opens its own sockets.
* ``worker_shutdown``: stop the heartbeat and leave the pool at once on a clean stop.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from ..errors import ConfigError, GpuHedgeError
from ..gpus import query_nvidia_smi
from ..store.connection import reset_clients
from ..store.leases import GpuInfo
from .app import glue_config

log = logging.getLogger(__name__)

_host: dict[str, Any] = {}


@signals.celeryd_after_setup.connect
def _check_gpu_worker(sender: str, instance: Any, **_: Any) -> None:
    config = glue_config()
    if not config.is_gpu_worker:
        return
    pool_name = getattr(instance.pool_cls, "__name__", str(instance.pool_cls)).lower()
    if instance.concurrency != 1 or not (
        "prefork" in pool_name or "taskpool" in pool_name or "solo" in pool_name
    ):
        raise ConfigError(
            f"a GPU worker runs one job at a time: expected --concurrency 1 with the prefork "
            f"or solo pool, got {instance.concurrency} with {pool_name}",
            key="GPUHEDGE_GPU",
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
    info = GpuInfo(config.gpu_id, config.pool, hostname, gpu_labels(config.gpu, config.labels))
    _host["service"] = GpuHost(
        store, info, host_ttl_ms=config.host_ttl_ms, pool_ttl_ms=config.pool_ttl_ms
    ).start()


@signals.worker_shutdown.connect
def _stop_gpu_host(**_: Any) -> None:
    service = _host.pop("service", None)
    if service is not None:
        service.stop()


@signals.worker_process_init.connect
def _fresh_clients(**_: Any) -> None:
    reset_clients()
