"""The GPU worker's health sampler: NVML every few seconds, acted on and reported.

A thread of the GPU worker's main process (NVML creates no CUDA context, so the main process may
use it) reads its GPU through :mod:`gpuhedge_celery.nvml` every ``GPUHEDGE_HEALTH_INTERVAL_S``,
judges the reading with :func:`gpuhedge_celery.core.gpu_health.assess` against the worker's own
processes (its main process and every descendant: the prefork child, a model server it started),
and then:

* writes the reading to ``<prefix>:{pool:<pool>}:health:<gpu>`` (expires after three intervals),
  which ``gpuhedge-celery leases`` shows, and keeps it for the ``gpuhedge_gpus`` control reply,
  which the reconcile pass collects;
* keeps the GPU out of the pool (reason ``health``) while another process holds its memory,
  and puts it back once that process is gone;
* drains the GPU (reason ``fault``) on uncorrected ECC errors or a hardware Xid: it stays out
  until an operator runs ``gpuhedge-celery gpus undrain``.

``GPUHEDGE_HEALTH=auto`` (the default) samples only where NVML answers; ``on`` logs an error
where it does not; ``off`` never samples. ``GPUHEDGE_NVML_REPLAY=FILE`` reads recorded answers.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from ..core.gpu_health import Assessment, assess
from ..core.lease_rules import OUT_FAULT, OUT_HEALTH
from ..errors import GpuHedgeError
from ..nvml import NvmlSource, NvmlUnavailable, open_source
from ..store.availability import clear_out, set_out, write_health
from ..store.leases import LeaseStore, now_ms

log = logging.getLogger(__name__)

_running: dict[str, HealthMonitor] = {}  # this process's sampler, for the control reply


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it (Linux ``/proc``; just ``root`` elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return {root}
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rpartition(")")[2].split()[1])  # the command may contain spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def gpu_index(config: Any) -> int | None:
    """The NVML index of this worker's GPU: ``GPUHEDGE_GPU`` (or the part after ``host:``)."""
    index = (config.gpu or "").rpartition(":")[2]
    return int(index) if index.isdigit() else None


class HealthMonitor:
    """Samples one GPU on a thread and keeps its pool membership in line with what it finds."""

    def __init__(
        self,
        source: NvmlSource,
        store: LeaseStore,
        gpu_id: str,
        index: int,
        *,
        interval_s: float,
        foreign_mb: float,
        xid_ignore: tuple[int, ...],
        root_pid: int | None = None,
    ):
        self.source, self.store, self.gpu_id, self.index = source, store, gpu_id, index
        self.interval_s, self.foreign_mb, self.xid_ignore = interval_s, foreign_mb, xid_ignore
        self.root_pid = root_pid or os.getpid()
        self.last: dict[str, Any] | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HealthMonitor:
        try:
            self.check()  # before the GPU joins the pool: a GPU already unhealthy never does
        except Exception:  # noqa: BLE001 - the worker starts all the same; the loop retries
            log.exception("health check of GPU %s failed", self.gpu_id)
        self._thread = threading.Thread(target=self._loop, name="gpuhedge-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if _running.get("monitor") is self:
            del _running["monitor"]
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.source.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the sampler must not die silently
                log.exception("health check of GPU %s failed", self.gpu_id)

    def check(self) -> Assessment:
        """One sample: judge it, publish it, and take the GPU out (or back) accordingly."""
        found = assess(
            self.source.sample(self.index),
            process_tree(self.root_pid),
            foreign_mb=self.foreign_mb,
            xid_ignore=self.xid_ignore,
            at_ms=now_ms(),
        )
        found.report["source"] = self.source.name
        self.last = found.report
        self.samples += 1
        try:
            write_health(self.store, self.gpu_id, found.report, int(self.interval_s * 3000) + 1000)
            if found.fault is not None:
                log.error("GPU %s drained: %s", self.gpu_id, found.fault)
                set_out(self.store, self.gpu_id, OUT_FAULT, found.fault)
            if found.health is not None:
                log.warning("GPU %s out of the pool: %s", self.gpu_id, found.health)
                set_out(self.store, self.gpu_id, OUT_HEALTH, found.health)
            elif found.report.get("error") is None:
                clear_out(self.store, self.gpu_id, OUT_HEALTH)
        except GpuHedgeError as e:
            log.warning("could not publish the health of GPU %s: %s", self.gpu_id, e)
        return found


def start_health_monitor(config: Any, store: LeaseStore) -> HealthMonitor | None:
    """The running sampler for this GPU worker, or None (health off, or no NVML here)."""
    if config.health == "off":
        return None
    index = gpu_index(config)
    if index is None:
        log.warning("GPU health not sampled: no NVML index in GPUHEDGE_GPU=%r", config.gpu)
        return None
    try:
        source = open_source(config.nvml_replay, [index])
    except NvmlUnavailable as e:
        (log.error if config.health == "on" else log.info)("GPU health not sampled: %s", e)
        return None
    monitor = HealthMonitor(
        source,
        store,
        config.gpu_id,
        index,
        interval_s=config.health_interval_s,
        foreign_mb=config.foreign_memory_mb,
        xid_ignore=config.xid_ignore,
    )
    _running["monitor"] = monitor.start()
    return monitor


def last_health() -> dict[str, Any] | None:
    """This worker's latest reading (for the ``gpuhedge_gpus`` control reply), if it samples."""
    monitor = _running.get("monitor")
    return None if monitor is None else monitor.last
