"""Which GPUs this host has: from configuration, or discovered with ``nvidia-smi``.

``GPUHEDGE_GPUS`` decides: a comma list of indices (``0,1,3``), ``none``, or ``auto`` (the
default: ask ``nvidia-smi`` when it is installed, otherwise no GPU). A GPU's id in the lease table
is ``<host>:<index>`` unless configured otherwise, so ids stay unique across hosts.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass, field

from .errors import ConfigError

NVIDIA_SMI_QUERY = ["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class LocalGpu:
    """One GPU of this host as discovery sees it; ``labels`` go into the lease registry."""

    index: str
    uuid: str | None = None
    name: str | None = None
    memory_mb: int | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def gpu_id(self, host: str) -> str:
        """The GPU's id in the lease table: ``<host>:<index>``."""
        return f"{host}:{self.index}"


def default_host() -> str:
    """This machine's short host name (the default owner name of its GPUs)."""
    return socket.gethostname().split(".")[0] or "localhost"


def parse_labels(text: str | None, *, key: str = "GPUHEDGE_GPU_LABELS") -> dict[str, str]:
    """Parse ``k=v,k2=v2`` into a dict; ConfigError naming ``key`` on a malformed item."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"expected k=v items separated by commas, got {item!r}", key=key)
        labels[name.strip()] = value.strip()
    return labels


def parse_nvidia_smi(text: str) -> list[LocalGpu]:
    """Parse ``nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,...``."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 4 or not cells[0].isdigit():
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        memory = int(float(cells[3])) if cells[3].replace(".", "", 1).isdigit() else None
        labels = {"model": cells[2]}
        if memory is not None:
            labels["vram_mb"] = str(memory)
        gpus.append(LocalGpu(cells[0], cells[1] or None, cells[2] or None, memory, labels))
    return gpus


def query_nvidia_smi(binary: str | None = None, timeout_s: float = 10.0) -> list[LocalGpu]:
    """The GPUs ``nvidia-smi`` reports; ``[]`` when it is not installed or finds no device."""
    binary = binary or shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        done = subprocess.run(
            [binary, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []  # driver present but no device (or no permission): the host has no usable GPU
    return parse_nvidia_smi(done.stdout)


def discover_gpus(spec: str | None = "auto", *, nvidia_smi: str | None = None) -> list[LocalGpu]:
    """This host's GPUs from ``spec`` (``auto``, ``none`` or ``0,1,...``; see module docstring)."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return query_nvidia_smi(nvidia_smi)
    if spec == "none":
        return []
    indices = [part.strip() for part in spec.split(",") if part.strip()]
    bad = [i for i in indices if not i.isdigit()]
    if bad or not indices:
        raise ConfigError(
            f"expected 'auto', 'none' or GPU indices like '0,1', got {spec!r}", key="GPUHEDGE_GPUS"
        )
    if len(set(indices)) != len(indices):
        raise ConfigError(f"GPU index listed twice in {spec!r}", key="GPUHEDGE_GPUS")
    return [LocalGpu(i) for i in indices]
