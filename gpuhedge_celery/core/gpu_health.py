"""GPU health rules: what NVML's answers about one GPU mean for its place in the pool.

Pure code: the GPU worker (``tasks/health.py``) reads NVML through a seam
(``gpuhedge_celery/nvml.py``: the real library, or recorded answers), turns the answers into a
:class:`DeviceSample` with :func:`device_sample`, and :func:`assess` decides:

* **foreign memory**: processes on the GPU that are not the worker's own (its main process, its
  prefork child, the model server it started, their children) hold at least ``foreign_mb`` of
  its memory between them (a process whose usage NVML cannot report counts as holding it) → the
  GPU is kept out of the pool (reason ``health``) until they are gone;
* **faults**: uncorrected ECC errors since the driver loaded (volatile count > 0), or an Xid
  critical-error event other than those raised by applications (``xid_ignore``) → the GPU is
  drained (reason ``fault``) until an operator undrains it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024
# Xids that applications cause (bad memory access, an exception in a kernel, a killed context),
# so they say nothing about the hardware.
APP_XIDS = (13, 31, 43, 45)


@dataclass(frozen=True)
class GpuProcess:
    """A process with a context on the GPU, and the memory NVML says it uses (None: unknown)."""

    pid: int
    used_mb: float | None = None


@dataclass(frozen=True)
class DeviceSample:
    """One reading of one GPU."""

    index: int
    name: str = ""
    uuid: str = ""
    memory_total_mb: float | None = None
    memory_used_mb: float | None = None
    utilization_pct: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    ecc_uncorrected: int | None = None  # volatile count; None: ECC not supported or off
    xids: tuple[int, ...] = ()  # Xid critical-error events since the previous reading
    error: str | None = None  # NVML could not be read


@dataclass(frozen=True)
class Assessment:
    """What a sample means: the sample as reported (JSON-ready), and the reasons, if any, to keep
    the GPU out of the pool (``health``) or to drain it (``fault``)."""

    report: dict[str, Any]
    health: str | None = None
    fault: str | None = None
    foreign: tuple[GpuProcess, ...] = field(default=())


def _mb(value: Any) -> float | None:
    return None if value is None else round(float(value) / MIB, 1)


def device_sample(index: int, answers: Mapping[str, Any]) -> DeviceSample:
    """A :class:`DeviceSample` from NVML's answers about one device, as the seam records them:
    ``name``, ``uuid``, ``memory`` (``total``/``used`` bytes), ``utilization`` (``gpu`` %),
    ``compute_processes`` and ``graphics_processes`` (``pid``, ``usedGpuMemory`` bytes or
    null), ``ecc_volatile_uncorrected`` (or null), ``xid_events`` (Xid numbers), ``error``."""
    if answers.get("error"):
        return DeviceSample(index, error=str(answers["error"]))
    memory = answers.get("memory") or {}
    procs: dict[int, GpuProcess] = {}
    listed = [*(answers.get("compute_processes") or []), *(answers.get("graphics_processes") or [])]
    for p in listed:
        pid = int(p["pid"])
        used = _mb(p.get("usedGpuMemory"))
        known = procs.get(pid)
        if known is not None and known.used_mb is not None and used is not None:
            used += known.used_mb  # the same process with a compute and a graphics context
        procs[pid] = GpuProcess(pid, used)
    ecc = answers.get("ecc_volatile_uncorrected")
    util = (answers.get("utilization") or {}).get("gpu")
    return DeviceSample(
        index=index,
        name=str(answers.get("name") or ""),
        uuid=str(answers.get("uuid") or ""),
        memory_total_mb=_mb(memory.get("total")),
        memory_used_mb=_mb(memory.get("used")),
        utilization_pct=None if util is None else int(util),
        processes=tuple(sorted(procs.values(), key=lambda p: p.pid)),
        ecc_uncorrected=None if ecc is None else int(ecc),
        xids=tuple(int(x) for x in answers.get("xid_events") or ()),
    )


def assess(
    sample: DeviceSample,
    ours: Iterable[int],
    *,
    foreign_mb: float = 256.0,
    xid_ignore: Iterable[int] = APP_XIDS,
    at_ms: int = 0,
) -> Assessment:
    """Judge one sample (see the module docstring). ``ours``: the worker's own process ids."""
    if sample.error is not None:
        report = {"index": sample.index, "error": sample.error, "at_ms": at_ms}
        return Assessment(report)
    own = set(ours)
    foreign = tuple(p for p in sample.processes if p.pid not in own)
    unknown = any(p.used_mb is None for p in foreign)
    health = None
    if foreign and (unknown or sum(p.used_mb or 0 for p in foreign) >= foreign_mb):
        who = ", ".join(
            f"pid {p.pid} ({'?' if p.used_mb is None else f'{p.used_mb:.0f}'} MiB)" for p in foreign
        )
        health = f"memory held by a process that is not this worker's: {who}"
    fault = None
    ignored = set(xid_ignore)
    hard = [x for x in sample.xids if x not in ignored]
    if sample.ecc_uncorrected:
        fault = f"{sample.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded"
    elif hard:
        fault = "Xid error " + ", ".join(str(x) for x in hard)
    report = {
        "index": sample.index,
        "name": sample.name,
        "uuid": sample.uuid,
        "memory_total_mb": sample.memory_total_mb,
        "memory_used_mb": sample.memory_used_mb,
        "utilization_pct": sample.utilization_pct,
        "processes": [
            {"pid": p.pid, "used_mb": p.used_mb, "ours": p.pid in own} for p in sample.processes
        ],
        "ecc_uncorrected": sample.ecc_uncorrected,
        "xids": list(sample.xids),
        "health": health,
        "fault": fault,
        "at_ms": at_ms,
    }
    return Assessment(report, health, fault, foreign)
