"""The Celery side's settings (``GPUHEDGE_*`` environment variables), read once and validated.

Each value is mirrored into the Celery configuration as ``gpuhedge_<name>`` so ``celery inspect
conf`` shows what a worker runs with. Bad values raise :class:`ConfigError` naming the variable.

=================================  ==========  ===============================================
variable                           default     meaning
=================================  ==========  ===============================================
GPUHEDGE_REDIS_URL, _PREFIX        (Settings)  broker, results and leases; lease key prefix
GPUHEDGE_BROKER_PREFIX             ""          prefix of Celery's own keys (broker, results,
                                               remote control); "" keeps Celery's layout so
                                               other Celery apps can call our tasks by name
GPUHEDGE_VISIBILITY_TIMEOUT_S      3600        Redis-broker redelivery of a message whose whole
                                               worker died (see docs/gpu-workers.md)
GPUHEDGE_RESTORE_INTERVAL_S        10          how often workers sweep for such messages
GPUHEDGE_RECONCILE_INTERVAL_S      30          beat period of the reconcile pass
GPUHEDGE_RECONCILE_GRACE_S         10          a lease on an idle GPU younger than this is left
GPUHEDGE_CONTROL_TIMEOUT_S         1.0         how long reconcile waits for GPU workers' replies
GPUHEDGE_HOST_TTL_MS               15000       a GPU worker's heartbeat lifetime (renewed at 1/3)
GPUHEDGE_COORD_CONCURRENCY         32          threads of a coordination worker (waiters block)
GPUHEDGE_ACQUIRE_TIMEOUT_S         none        pooled_infer gives up waiting after this
GPUHEDGE_MAX_ATTEMPTS              3           times a request may go back to waiting after its
                                               lease was lost or refused
GPUHEDGE_GPU                       none        makes this worker a GPU worker for that GPU:
                                               an index (0) or a full id (host:0)
GPUHEDGE_POOL                      default     the GPU's pool
GPUHEDGE_GPU_LABELS                ""          k=v,k2=v2 labels a router may match on
GPUHEDGE_HOST                      hostname    host part of default GPU ids
GPUHEDGE_RUNNER                    cpu         runner spec (gpuhedge_celery.runners)
GPUHEDGE_POOL_TTL_MS               none        sets the pool's lease TTL at registration
=================================  ==========  ===============================================
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from ..errors import ConfigError
from ..gpus import default_host, parse_labels
from ..runners import runner_from_spec
from ..settings import Settings

_GPU_RE = re.compile(r"^[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)?$")


def _number(
    env: Mapping[str, str],
    name: str,
    default: float | None,
    *,
    minimum: float = 0.0,
    integer: bool = False,
    strict: bool = True,
) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "" or raw.strip().lower() == "none":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"expected {kind}, got {raw!r}", key=name) from None
    if value < minimum or (strict and value == minimum):
        sign = ">" if strict else ">="
        raise ConfigError(f"expected a value {sign} {minimum:g}, got {raw!r}", key=name)
    return value


@dataclass(frozen=True)
class GlueConfig:
    """Everything the Celery glue reads from the environment, validated."""

    settings: Settings = field(default_factory=Settings)
    broker_prefix: str = ""
    visibility_timeout_s: float = 3600.0
    restore_interval_s: float = 10.0
    reconcile_interval_s: float = 30.0
    reconcile_grace_s: float = 10.0
    control_timeout_s: float = 1.0
    host_ttl_ms: int = 15_000
    coord_concurrency: int = 32
    acquire_timeout_s: float | None = None
    max_attempts: int = 3
    gpu: str | None = None
    pool: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    host: str = field(default_factory=default_host)
    runner: str = "cpu"
    pool_ttl_ms: int | None = None

    @property
    def is_gpu_worker(self) -> bool:
        """True when this process serves one GPU (``GPUHEDGE_GPU`` is set)."""
        return self.gpu is not None

    @property
    def gpu_id(self) -> str | None:
        """This worker's GPU id in the lease table (``host:index`` unless given in full)."""
        if self.gpu is None:
            return None
        return self.gpu if ":" in self.gpu else f"{self.host}:{self.gpu}"

    def as_celery_conf(self) -> dict[str, object]:
        """The values as ``gpuhedge_*`` Celery settings (secrets left out)."""
        data = asdict(self)
        data.pop("settings")
        data["prefix"] = self.settings.prefix
        data["gpu_id"] = self.gpu_id
        return {f"gpuhedge_{k}": v for k, v in data.items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GlueConfig:
        """Read and validate every ``GPUHEDGE_*`` variable of the table above."""
        env = os.environ if environ is None else environ
        settings = Settings.from_env(dict(env))
        gpu = (env.get("GPUHEDGE_GPU") or "").strip() or None
        if gpu is not None and not _GPU_RE.match(gpu):
            raise ConfigError(
                f"expected a GPU index or id like 'host:0', got {gpu!r}", key="GPUHEDGE_GPU"
            )
        runner = (env.get("GPUHEDGE_RUNNER") or "cpu").strip()
        if gpu is not None:
            runner_from_spec(runner)  # fail at start-up, not at the first job
        pool = (env.get("GPUHEDGE_POOL") or "default").strip()
        if not pool or any(c in pool for c in " :*?[]"):
            raise ConfigError(
                f"expected a pool name without spaces or ':', got {pool!r}", key="GPUHEDGE_POOL"
            )
        pool_ttl = _number(env, "GPUHEDGE_POOL_TTL_MS", None, integer=True)
        acquire = _number(env, "GPUHEDGE_ACQUIRE_TIMEOUT_S", None)
        return cls(
            settings=settings,
            broker_prefix=env.get("GPUHEDGE_BROKER_PREFIX", ""),
            visibility_timeout_s=_number(env, "GPUHEDGE_VISIBILITY_TIMEOUT_S", 3600.0),
            restore_interval_s=_number(env, "GPUHEDGE_RESTORE_INTERVAL_S", 10.0),
            reconcile_interval_s=_number(env, "GPUHEDGE_RECONCILE_INTERVAL_S", 30.0),
            reconcile_grace_s=_number(env, "GPUHEDGE_RECONCILE_GRACE_S", 10.0, strict=False),
            control_timeout_s=_number(env, "GPUHEDGE_CONTROL_TIMEOUT_S", 1.0),
            host_ttl_ms=int(_number(env, "GPUHEDGE_HOST_TTL_MS", 15_000, integer=True)),
            coord_concurrency=int(_number(env, "GPUHEDGE_COORD_CONCURRENCY", 32, integer=True)),
            acquire_timeout_s=acquire,
            max_attempts=int(_number(env, "GPUHEDGE_MAX_ATTEMPTS", 3, integer=True)),
            gpu=gpu,
            pool=pool,
            labels=parse_labels(env.get("GPUHEDGE_GPU_LABELS")),
            host=(env.get("GPUHEDGE_HOST") or "").strip() or default_host(),
            runner=runner,
            pool_ttl_ms=None if pool_ttl is None else int(pool_ttl),
        )
