"""The Celery side's settings (``GPUHEDGE_*`` environment variables), read once and validated.

Each value is mirrored into the Celery configuration as ``gpuhedge_<name>`` so ``celery inspect
conf`` shows what a worker runs with. Bad values raise :class:`ConfigError` naming the variable.

=================================  ==========  ===============================================
variable                           default     meaning
=================================  ==========  ===============================================
GPUHEDGE_REDIS_URL, _PREFIX        (Settings)  results and leases (and the broker unless
                                               GPUHEDGE_BROKER_URL is set); lease key prefix
GPUHEDGE_BROKER_URL                none        the Celery broker when it is not that Redis:
                                               amqp:// (RabbitMQ) or another redis:// URL
GPUHEDGE_BROKER_PREFIX             (derived)   prefix of Celery's own keys (broker, results,
                                               remote control); unset: "<GPUHEDGE_PREFIX>:"
                                               for a prefix other than the default, else "";
                                               "" keeps Celery's layout so other Celery apps
                                               can call our tasks by name
GPUHEDGE_VISIBILITY_TIMEOUT_S      3600        Redis-broker redelivery of a message whose whole
                                               worker died (see docs/gpu-workers.md); RabbitMQ
                                               redelivers when the connection drops instead
GPUHEDGE_RESTORE_INTERVAL_S        10          how often workers sweep for such messages
GPUHEDGE_RECONCILE_INTERVAL_S      30          beat period of the reconcile pass
GPUHEDGE_BEAT_SCHEDULE             (state dir) beat's schedule file; default
                                               $XDG_STATE_HOME (~/.local/state)/gpuhedge-celery/
                                               celerybeat-schedule-<prefix>, never the cwd
GPUHEDGE_RECONCILE_GRACE_S         10          a lease on an idle GPU younger than this is left
GPUHEDGE_CONTROL_TIMEOUT_S         1.0         how long reconcile waits for GPU workers' replies
GPUHEDGE_HOST_TTL_MS               15000       a GPU worker's heartbeat lifetime (renewed at 1/3)
GPUHEDGE_COORD_CONCURRENCY         32          threads of a coordination worker (waiters block)
GPUHEDGE_COORD_QUEUES              all three   queues a coordination worker consumes, comma-
                                               separated: gpuhedge.coord (races, reconcile),
                                               gpuhedge.attempts, gpuhedge.pool (pooled waits)
GPUHEDGE_ACQUIRE_TIMEOUT_S         none        pooled_infer gives up waiting after this
GPUHEDGE_MAX_ATTEMPTS              3           times a request may go back to waiting after its
                                               lease was lost or refused
GPUHEDGE_POOL_DIRECT               on          a caller that finds a GPU free and nobody
                                               waiting sends the job straight to that GPU
                                               (tasks/pooled_direct.py); off: always through
                                               a coordination worker's wait
GPUHEDGE_GPU                       none        makes this worker a GPU worker for that GPU:
                                               an index (0) or a full id (host:0)
GPUHEDGE_POOL                      default     the GPU's pool
GPUHEDGE_GPU_LABELS                ""          k=v,k2=v2 labels a router may match on
GPUHEDGE_HOST                      hostname    host part of default GPU ids
GPUHEDGE_RUNNER                    cpu         runner spec (gpuhedge_celery.runners)
GPUHEDGE_POOL_TTL_MS               none        sets the pool's lease TTL at registration
GPUHEDGE_RUNNER_RETRY_S            1.0         first retry of a failed model load (doubles)
GPUHEDGE_RUNNER_RETRY_MAX_S        60          longest retry delay (loads and server restarts)
GPUHEDGE_RUNNER_WAIT_S             30          how long a job waits for a loading model before
                                               it frees its lease and waits for a GPU again
GPUHEDGE_SERVER_CMD                none        starts the server: runner's model server
GPUHEDGE_MAX_TASKS_PER_CHILD       none        recycle the GPU worker's child after N jobs
GPUHEDGE_MAX_MEMORY_PER_CHILD_MB   none        ... or once its resident memory passes this
GPUHEDGE_HEALTH                    auto        GPU health from NVML: auto (when NVML answers),
                                               on (a missing NVML is logged as an error), off
GPUHEDGE_HEALTH_INTERVAL_S         5           how often the GPU worker samples its GPU
GPUHEDGE_FOREIGN_MEMORY_MB         256         memory another process may hold on the GPU
                                               before the GPU leaves the pool
GPUHEDGE_XID_IGNORE                13,31,43,45 Xid errors that do not drain the GPU (raised by
                                               applications, not hardware)
GPUHEDGE_NVML_REPLAY               none        read NVML's answers from this JSON file instead
                                               (recorded with python -m gpuhedge_celery.nvml)
=================================  ==========  ===============================================
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from ..envvars import env_flag
from ..errors import ConfigError
from ..gpus import default_host, parse_labels
from ..runners import runner_from_spec
from ..settings import Settings, broker_prefix, redact_url

BROKER_SCHEMES = {"redis": "redis", "rediss": "redis", "amqp": "amqp", "amqps": "amqp",
                  "pyamqp": "amqp"}  # fmt: skip
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


def default_schedule(env: Mapping[str, str], prefix: str) -> str:
    """Beat's schedule file (tasks/beat.py) in the user's state directory (the temp dir when
    there is none)."""
    base = env.get("XDG_STATE_HOME") or ""
    if not base:
        home = env.get("HOME") or os.path.expanduser("~")
        base = os.path.join(home, ".local", "state") if home != "~" else tempfile.gettempdir()
    return os.path.join(base, "gpuhedge-celery", f"celerybeat-schedule-{prefix}")


COORD_QUEUES = ("gpuhedge.coord", "gpuhedge.attempts", "gpuhedge.pool")


def parse_coord_queues(text: str | None) -> tuple[str, ...]:
    """``GPUHEDGE_COORD_QUEUES``: the comma-separated queues a coordination worker consumes."""
    if text is None or not text.strip():
        return COORD_QUEUES
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in COORD_QUEUES]
    if unknown or not names:
        raise ConfigError(
            f"unknown queue {unknown[0]!r}; expected some of {', '.join(COORD_QUEUES)}"
            if unknown
            else "no queue named",
            key="GPUHEDGE_COORD_QUEUES",
        )
    return names


@dataclass(frozen=True)
class GlueConfig:
    """Everything the Celery glue reads from the environment, validated."""

    settings: Settings = field(default_factory=Settings)
    broker_prefix: str = ""
    broker_url: str | None = field(default=None, repr=False)  # may carry a password
    visibility_timeout_s: float = 3600.0
    restore_interval_s: float = 10.0
    reconcile_interval_s: float = 30.0
    reconcile_grace_s: float = 10.0
    control_timeout_s: float = 1.0
    host_ttl_ms: int = 15_000
    coord_concurrency: int = 32
    coord_queues: tuple[str, ...] = COORD_QUEUES
    acquire_timeout_s: float | None = None
    max_attempts: int = 3
    pool_direct: bool = True
    gpu: str | None = None
    pool: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    host: str = field(default_factory=default_host)
    runner: str = "cpu"
    pool_ttl_ms: int | None = None
    beat_schedule: str = ""  # "" = default_schedule(the environment, the prefix)
    runner_retry_s: float = 1.0
    runner_retry_max_s: float = 60.0
    runner_wait_s: float = 30.0
    server_cmd: str | None = None
    max_tasks_per_child: int | None = None
    max_memory_per_child_mb: int | None = None
    health: str = "auto"
    health_interval_s: float = 5.0
    foreign_memory_mb: float = 256.0
    xid_ignore: tuple[int, ...] = (13, 31, 43, 45)
    nvml_replay: str | None = None

    def __post_init__(self) -> None:
        if not self.beat_schedule:
            schedule = default_schedule(os.environ, self.settings.prefix)
            object.__setattr__(self, "beat_schedule", schedule)

    @property
    def is_gpu_worker(self) -> bool:
        """True when this process serves one GPU (``GPUHEDGE_GPU`` is set)."""
        return self.gpu is not None

    @property
    def broker(self) -> str:
        """The Celery broker's URL: ``GPUHEDGE_BROKER_URL``, else the Redis of everything else."""
        return self.broker_url or self.settings.redis_url

    @property
    def broker_kind(self) -> str:
        """``"redis"`` or ``"amqp"`` (RabbitMQ): what the broker's redelivery rules are."""
        return BROKER_SCHEMES[self.broker.partition(":")[0].lower()]

    @property
    def gpu_id(self) -> str | None:
        """This worker's GPU id in the lease table (``host:index`` unless given in full)."""
        if self.gpu is None:
            return None
        return self.gpu if ":" in self.gpu else f"{self.host}:{self.gpu}"

    def default_nodename(self, host: str) -> str:
        """The worker's node name on ``host`` when ``-n`` is not given: one per role, so a
        coordination worker and the GPU workers of one host never share ``celery@<host>``
        (``coord@<host>``, ``gpu<index>@<host>``; ``gpu-<host>-<index>`` for a full GPU id)."""
        if self.gpu is None:
            return f"coord@{host}"
        name = f"gpu{self.gpu}" if ":" not in self.gpu else "gpu-" + self.gpu.replace(":", "-")
        return f"{name}@{host}"

    def as_celery_conf(self) -> dict[str, object]:
        """The values as ``gpuhedge_*`` Celery settings (secrets left out)."""
        data = asdict(self)
        data.pop("settings")
        data["prefix"] = self.settings.prefix
        data["broker_url"] = None if self.broker_url is None else redact_url(self.broker_url)
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
        broker_url = (env.get("GPUHEDGE_BROKER_URL") or "").strip() or None
        scheme, sep, _ = (broker_url or "").partition("://")
        if broker_url is not None and (not sep or scheme.lower() not in BROKER_SCHEMES):
            raise ConfigError(
                f"expected an amqp://, amqps:// or redis:// URL, got {redact_url(broker_url)!r}",
                key="GPUHEDGE_BROKER_URL",
            )
        health = (env.get("GPUHEDGE_HEALTH") or "auto").strip().lower()
        if health not in ("auto", "on", "off"):
            raise ConfigError(f"expected auto, on or off, got {health!r}", key="GPUHEDGE_HEALTH")
        xids = (env.get("GPUHEDGE_XID_IGNORE") or "13,31,43,45").replace(" ", "")
        if not all(x.isdigit() for x in filter(None, xids.split(","))):
            raise ConfigError(
                f"expected Xid numbers like 13,31, got {xids!r}", key="GPUHEDGE_XID_IGNORE"
            )
        server_cmd = (env.get("GPUHEDGE_SERVER_CMD") or "").strip() or None
        if server_cmd is not None:
            try:
                shlex.split(server_cmd)
            except ValueError as e:
                raise ConfigError(
                    f"cannot parse the command: {e}", key="GPUHEDGE_SERVER_CMD"
                ) from None
        per_child = _number(env, "GPUHEDGE_MAX_TASKS_PER_CHILD", None, integer=True)
        per_child_mb = _number(env, "GPUHEDGE_MAX_MEMORY_PER_CHILD_MB", None, integer=True)
        return cls(
            settings=settings,
            broker_prefix=broker_prefix(env, settings.prefix),
            broker_url=broker_url,
            visibility_timeout_s=_number(env, "GPUHEDGE_VISIBILITY_TIMEOUT_S", 3600.0),
            restore_interval_s=_number(env, "GPUHEDGE_RESTORE_INTERVAL_S", 10.0),
            reconcile_interval_s=_number(env, "GPUHEDGE_RECONCILE_INTERVAL_S", 30.0),
            reconcile_grace_s=_number(env, "GPUHEDGE_RECONCILE_GRACE_S", 10.0, strict=False),
            control_timeout_s=_number(env, "GPUHEDGE_CONTROL_TIMEOUT_S", 1.0),
            host_ttl_ms=int(_number(env, "GPUHEDGE_HOST_TTL_MS", 15_000, integer=True)),
            coord_concurrency=int(_number(env, "GPUHEDGE_COORD_CONCURRENCY", 32, integer=True)),
            coord_queues=parse_coord_queues(env.get("GPUHEDGE_COORD_QUEUES")),
            acquire_timeout_s=acquire,
            max_attempts=int(_number(env, "GPUHEDGE_MAX_ATTEMPTS", 3, integer=True)),
            pool_direct=env_flag(env, "GPUHEDGE_POOL_DIRECT", True),
            gpu=gpu,
            pool=pool,
            labels=parse_labels(env.get("GPUHEDGE_GPU_LABELS")),
            host=(env.get("GPUHEDGE_HOST") or "").strip() or default_host(),
            runner=runner,
            pool_ttl_ms=None if pool_ttl is None else int(pool_ttl),
            beat_schedule=(env.get("GPUHEDGE_BEAT_SCHEDULE") or "").strip()
            or default_schedule(env, settings.prefix),
            runner_retry_s=_number(env, "GPUHEDGE_RUNNER_RETRY_S", 1.0),
            runner_retry_max_s=_number(env, "GPUHEDGE_RUNNER_RETRY_MAX_S", 60.0),
            runner_wait_s=_number(env, "GPUHEDGE_RUNNER_WAIT_S", 30.0, strict=False),
            server_cmd=server_cmd,
            max_tasks_per_child=None if per_child is None else int(per_child),
            max_memory_per_child_mb=None if per_child_mb is None else int(per_child_mb),
            health=health,
            health_interval_s=_number(env, "GPUHEDGE_HEALTH_INTERVAL_S", 5.0),
            foreign_memory_mb=_number(env, "GPUHEDGE_FOREIGN_MEMORY_MB", 256.0, strict=False),
            xid_ignore=tuple(sorted({int(x) for x in xids.split(",") if x})),
            nvml_replay=(env.get("GPUHEDGE_NVML_REPLAY") or "").strip() or None,
        )
