"""The seam between GPU workers and NVML: the real library, or answers recorded from it.

``PynvmlSource`` asks NVML through ``nvidia-ml-py`` (``pip install 'gpuhedge-celery[gpu]'``;
it imports as ``pynvml``) for one device's memory, utilisation, processes, volatile uncorrected
ECC count and Xid critical-error events (an event set registered when the source opens, read
without waiting at each sample). ``ReplaySource`` reads the same answers from a JSON file,
re-read at every sample so a test (or an operator reproducing a host's state) can change them:

    {"source": "...", "driver": "...", "devices": {"0": {"name": ..., "uuid": ...,
      "memory": {"total": BYTES, "used": BYTES}, "utilization": {"gpu": PCT, "memory": PCT},
      "compute_processes": [{"pid": N, "usedGpuMemory": BYTES_OR_NULL}],
      "graphics_processes": [...], "ecc_volatile_uncorrected": N_OR_NULL, "xid_events": [N]}}}

``python -m gpuhedge_celery.nvml record [--out FILE]`` writes that file from the real NVML of
the host it runs on (``scripts/gpu-check.sh`` runs it); both sources turn answers into samples
with :func:`gpuhedge_celery.core.gpu_health.device_sample`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from .core.gpu_health import DeviceSample, device_sample
from .errors import GpuHedgeError


class NvmlUnavailable(GpuHedgeError):
    """NVML cannot be used here: the package is not installed, or no driver or device answers."""


class NvmlSource(Protocol):
    """Where a GPU worker reads its GPU's state from."""

    name: str

    def sample(self, index: int) -> DeviceSample: ...

    def close(self) -> None: ...


class ReplaySource:
    """NVML's answers read from a JSON file (see the module docstring), at every sample."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.name = f"replay:{path}"
        self.answers(0)  # a missing or malformed file fails at start, not at the first sample

    def answers(self, index: int) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise NvmlUnavailable(f"cannot read recorded NVML answers {self.path}: {e}") from e
        devices = data.get("devices") if isinstance(data, dict) else None
        if not isinstance(devices, dict):
            raise NvmlUnavailable(f"{self.path}: expected a 'devices' object")
        found = devices.get(str(index))
        return found if isinstance(found, dict) else {"error": f"no device {index} recorded"}

    def sample(self, index: int) -> DeviceSample:
        try:
            return device_sample(index, self.answers(index))
        except NvmlUnavailable as e:
            return DeviceSample(index, error=str(e))

    def close(self) -> None:
        pass


class PynvmlSource:
    """The real NVML, through ``nvidia-ml-py``."""

    name = "nvml"

    def __init__(self, indices: list[int] | None = None):
        try:
            import pynvml
        except ImportError as e:
            raise NvmlUnavailable(
                "nvidia-ml-py is not installed (pip install 'gpuhedge-celery[gpu]')"
            ) from e
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML did not start: {e}") from e
        self._events: dict[int, Any] = {}
        for index in indices or []:
            self._register_xids(index)

    def _register_xids(self, index: int) -> None:
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            self._events[index] = events
        except nvml.NVMLError:
            pass  # not supported on this device or driver: no Xid events, the rest still works

    def _optional(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except self.nvml.NVMLError:
            return None  # not supported (ECC on consumer GPUs, processes in some containers)

    def _xids(self, index: int) -> list[int]:
        events = self._events.get(index)
        found: list[int] = []
        while events is not None:
            try:
                data = self.nvml.nvmlEventSetWait_v2(events, 0)
            except self.nvml.NVMLError:
                break  # NVMLError_Timeout: nothing (more) happened
            found.append(int(data.eventData))
        return found

    def answers(self, index: int) -> dict[str, Any]:
        """NVML's answers about device ``index``, in the recorded shape."""
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            name, uuid = nvml.nvmlDeviceGetName(handle), nvml.nvmlDeviceGetUUID(handle)
        except nvml.NVMLError as e:
            return {"error": f"NVML: {e}"}
        util = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)

        def procs(call: Any) -> list[dict[str, Any]]:
            found = self._optional(call, handle) or []
            return [{"pid": int(p.pid), "usedGpuMemory": p.usedGpuMemory} for p in found]

        ecc = self._optional(
            nvml.nvmlDeviceGetTotalEccErrors,
            handle,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        return {
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "uuid": uuid.decode() if isinstance(uuid, bytes) else str(uuid),
            "memory": {"total": int(memory.total), "used": int(memory.used)},
            "utilization": None if util is None else {"gpu": util.gpu, "memory": util.memory},
            "compute_processes": procs(nvml.nvmlDeviceGetComputeRunningProcesses),
            "graphics_processes": procs(nvml.nvmlDeviceGetGraphicsRunningProcesses),
            "ecc_volatile_uncorrected": None if ecc is None else int(ecc),
            "xid_events": self._xids(index),
        }

    def sample(self, index: int) -> DeviceSample:
        return device_sample(index, self.answers(index))

    def device_count(self) -> int:
        return int(self.nvml.nvmlDeviceGetCount())

    def driver(self) -> str:
        version = self.nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def open_source(replay: str | None = None, indices: list[int] | None = None) -> NvmlSource:
    """Recorded answers when ``replay`` names a file, else the real NVML; NvmlUnavailable."""
    if replay:
        return ReplaySource(replay)
    return PynvmlSource(indices)


def record(source: PynvmlSource) -> dict[str, Any]:
    """Every device's answers, in the file format :class:`ReplaySource` reads."""
    count = source.device_count()
    return {
        "source": "nvml",
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "driver": source.driver(),
        "devices": {str(i): source.answers(i) for i in range(count)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuhedge_celery.nvml")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="write this host's NVML answers as replayable JSON")
    rec.add_argument("--out", default="-", help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    try:
        source = PynvmlSource()
    except NvmlUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        text = json.dumps(record(source), indent=2, sort_keys=True)
    finally:
        source.close()
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
