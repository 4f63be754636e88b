"""The Celery side's settings (the glue section of :func:`gpuhedge_celery.settings.current`).

Parsed from ``GPUHEDGE_*`` variables by :func:`gpuhedge_celery.envvars.glue_values`; each is
described in docs/configuration.md (*Environment variables*). Each value is mirrored into the
Celery configuration as ``gpuhedge_<name>`` so ``celery inspect conf`` shows what a worker runs
with. Bad values raise :class:`ConfigError` naming the variable.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from .. import envvars
from ..errors import ConfigError
from ..gpus import default_host, parse_labels
from ..names import COORD_QUEUES
from ..redis_url import is_cluster, is_sentinel, parse_sentinel_url
from ..runners import runner_from_spec
from ..shared_settings import Settings, redact_url

BROKER_SCHEMES = {
    "redis": "redis",
    "rediss": "redis",
    "sentinel": "redis",
    "amqp": "amqp",
    "amqps": "amqp",
    "pyamqp": "amqp",
}
GPU_RE = re.compile(r"^[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)?\Z")


def default_schedule(env: Mapping[str, str], prefix: str) -> str:
    """Beat's schedule file (tasks/beat.py) in the user's state directory (the temp dir when
    there is none)."""
    base = env.get("XDG_STATE_HOME") or ""
    if not base:
        home = env.get("HOME") or os.path.expanduser("~")
        base = os.path.join(home, ".local", "state") if home != "~" else tempfile.gettempdir()
    return os.path.join(base, "gpuhedge-celery", f"celerybeat-schedule-{prefix}")


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
            key=envvars.COORD_QUEUES_VAR,
        )
    return names


def _check_cluster_broker(broker_url: str | None) -> None:
    """A store on a Redis Cluster needs a broker of its own, and a Redis one: Celery and kombu
    cannot use a cluster, and Celery's results then follow the broker."""
    if broker_url is None:
        raise ConfigError(
            f"{envvars.REDIS_URL_VAR} names a Redis Cluster, which Celery cannot use as broker "
            "or result backend: set this to a Redis of its own (redis://, rediss:// or "
            "sentinel://) for the broker and Celery's results",
            key=envvars.BROKER_URL_VAR,
        )
    if BROKER_SCHEMES.get(broker_url.partition(":")[0].lower()) != "redis":
        raise ConfigError(
            f"with {envvars.REDIS_URL_VAR} on a Redis Cluster, Celery's results are kept on the "
            "broker, which must then be a Redis (redis://, rediss:// or sentinel://), got "
            f"{redact_url(broker_url)!r}",
            key=envvars.BROKER_URL_VAR,
        )


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
        if is_cluster(self.settings.redis_url):
            _check_cluster_broker(self.broker_url)

    @property
    def is_gpu_worker(self) -> bool:
        """True when this process serves one GPU (``GPUHEDGE_GPU`` is set)."""
        return self.gpu is not None

    @property
    def broker(self) -> str:
        """The Celery broker's URL: ``GPUHEDGE_BROKER_URL``, else the Redis of everything else."""
        return self.broker_url or self.settings.redis_url

    @property
    def results_url(self) -> str:
        """Where Celery keeps task results: the store's Redis, except on a Redis Cluster (which
        Celery cannot use), where they follow the broker (a Redis then: see
        :func:`_check_cluster_broker`)."""
        if is_cluster(self.settings.redis_url):
            return self.broker
        return self.settings.redis_url

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
        """Read and validate them from ``environ`` now (this process's environment by
        default); code running in a worker takes ``settings.current().glue`` instead."""
        env = os.environ if environ is None else environ
        settings = Settings.from_env(env)
        values = envvars.glue_values(env)
        gpu, runner, broker_url = values["gpu"], values["runner"], values["broker_url"]
        if gpu is not None and not GPU_RE.match(gpu):
            raise ConfigError(
                f"expected a GPU index or id like 'host:0', got {gpu!r}", key=envvars.GPU_VAR
            )
        if gpu is not None:
            runner_from_spec(runner)  # fail at start-up, not at the first job
        scheme, sep, _ = (broker_url or "").partition("://")
        if broker_url is not None and (not sep or scheme.lower() not in BROKER_SCHEMES):
            raise ConfigError(
                "expected an amqp://, amqps://, redis:// or sentinel:// URL, got "
                f"{redact_url(broker_url)!r}",
                key=envvars.BROKER_URL_VAR,
            )
        if broker_url is not None and is_sentinel(broker_url):
            parse_sentinel_url(broker_url, key=envvars.BROKER_URL_VAR)
        values.update(
            settings=settings,
            broker_prefix=envvars.broker_prefix(env, settings.prefix),
            coord_queues=parse_coord_queues(values["coord_queues"]),
            labels=parse_labels(values["labels"]),
            host=values["host"] or default_host(),
            beat_schedule=values["beat_schedule"] or default_schedule(env, settings.prefix),
        )
        return cls(**values)
