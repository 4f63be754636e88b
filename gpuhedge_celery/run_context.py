"""What every runner gets and may raise: the job's :class:`RunContext` and the runner errors.

Kept apart from :mod:`gpuhedge_celery.runners` (which re-exports them) so that runner kinds in
modules of their own, such as :mod:`gpuhedge_celery.server_runner`, build on them without an
import cycle.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import envvars
from .errors import GpuHedgeError
from .secrets import SECRET_NAME

# What a model command or model server inherits from the worker: what a program needs to run
# and find its GPU, libraries and caches, never the worker's own credentials (the Redis URL,
# the webhook secret, providers' keys). More names: GPUHEDGE_RUNNER_ENV=NAME,NAME.
CHILD_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "TERM",
        "PWD",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONUNBUFFERED",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "OPENBLAS_CORETYPE",
        "OPENBLAS_L2_SIZE",
        "XDG_CACHE_HOME",
        "XDG_RUNTIME_DIR",
        "TOKENIZERS_PARALLELISM",
    }
)
CHILD_ENV_PREFIXES = (
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "HF_",
    "TRANSFORMERS_",
    "TORCH_",
    "PYTORCH_",
    "NCCL_",
    "XLA_",
)
RUNNER_ENV_VAR = envvars.RUNNER_ENV_VAR


def child_env(
    extra: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a model command or model server: the allow-listed part of
    ``environ`` (this process's by default), the names ``GPUHEDGE_RUNNER_ENV`` lists, then
    ``extra``. A name under an allowed prefix that looks like a credential (``HF_TOKEN``)
    passes only when listed by name."""
    env = os.environ if environ is None else environ
    listed = envvars.runner_env_names(env)
    found = {
        name: value
        for name, value in env.items()
        if name in listed
        or name in CHILD_ENV_NAMES
        or (name.startswith(CHILD_ENV_PREFIXES) and not SECRET_NAME.search(name))
    }
    return {**found, **(extra or {})}


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
