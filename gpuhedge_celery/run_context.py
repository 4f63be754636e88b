"""What every runner gets and may raise: the job's :class:`RunContext` and the runner errors.

Kept apart from :mod:`gpuhedge_celery.runners` (which re-exports them) so that runner kinds in
modules of their own, such as :mod:`gpuhedge_celery.server_runner`, build on them without an
import cycle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .errors import GpuHedgeError


class RunnerStopped(GpuHedgeError):
    """The job was stopped before it finished because the worker lost the GPU's lease."""


class RunnerFailed(GpuHedgeError):
    """The runner itself failed (the callable raised, the command exited non-zero)."""


class RunnerUnavailable(GpuHedgeError):
    """The runner cannot serve now (its model is not loaded, its model server is down): the
    worker frees the lease at once and the request waits for a GPU again."""


@dataclass
class RunContext:
    """What a runner may know about the job it runs and how it learns it must stop."""

    gpu_id: str = ""
    token: int = 0
    task_id: str = ""
    stop: threading.Event = field(default_factory=threading.Event)
    env: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """Raise :class:`RunnerStopped` if the job must stop (call it between long steps)."""
        if self.stop.is_set():
            raise RunnerStopped(f"job on GPU {self.gpu_id!r} stopped: its lease was lost")
