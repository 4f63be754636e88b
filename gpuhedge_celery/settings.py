"""Process-wide settings read once from the environment (``GPUHEDGE_*``).

:func:`current` is this process's :class:`ProcessSettings`: one frozen object whose sections
(``core``, ``glue``, ``race``, ``webhooks``, ``janitor``, ``metrics``...) are each parsed and
validated on first use, then kept. Code takes the object (or a section) instead of reading
``os.environ``; only this module and ``envvars.py`` (the parsers) read ``GPUHEDGE_*``
variables. A test that changes the environment calls :func:`reload` (or builds
``ProcessSettings.from_env(env)`` from a mapping of its own). Every variable is listed once in
docs/configuration.md (*Environment variables*).

The shared section (:class:`Settings`, with :func:`redact_url`) lives in ``shared_settings.py``
and is re-exported here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from . import envvars
from .envvars import DEFAULT_PREFIX, DEFAULT_REDIS_URL, broker_prefix
from .race.settings import RaceSettings
from .shared_settings import Settings, redact_url, validate_redis_url
from .store.race_keys import RaceShards
from .tasks.config import GlueConfig
from .tasks.message_signing import Signing
from .webhooks.settings import WebhookSettings

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_REDIS_URL",
    "JanitorSettings",
    "MetricsSettings",
    "ProcessSettings",
    "Settings",
    "broker_prefix",
    "current",
    "redact_url",
    "reload",
    "validate_redis_url",
]


@dataclass(frozen=True)
class JanitorSettings:
    """The janitor's ``GPUHEDGE_JANITOR_*`` settings (tasks/janitor.py), validated."""

    stale_s: float = 30.0
    limit: int = 100

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JanitorSettings:
        return cls(**envvars.janitor_values(os.environ if environ is None else environ))


@dataclass(frozen=True)
class MetricsSettings:
    """A worker's ``/metrics`` endpoint (metrics/exposition.py): ``port`` None serves none."""

    enabled: bool = True
    port: int | None = None
    addr: str = envvars.METRICS_ADDR_DEFAULT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MetricsSettings:
        return cls(**envvars.metrics_values(os.environ if environ is None else environ))


@dataclass(frozen=True)
class ProcessSettings:
    """Every ``GPUHEDGE_*`` setting of one environment. Each section is parsed (and validated,
    a bad value being a one-line ConfigError naming the variable) the first time it is used,
    so a process is only refused for the variables it reads."""

    env: Mapping[str, str] = field(repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProcessSettings:
        return cls(os.environ if environ is None else environ)

    @cached_property
    def core(self) -> Settings:
        """Redis URL, key prefix, config file: what every process shares."""
        return Settings.from_env(self.env)

    @cached_property
    def glue(self) -> GlueConfig:
        """The Celery side: broker, worker roles, the GPU worker's runner and health."""
        return GlueConfig.from_env(self.env)

    @cached_property
    def race(self) -> RaceSettings:
        """Distributed races: receipts, timers, launches, events, records, plugins."""
        return RaceSettings.from_env(self.env)

    @cached_property
    def receipt_ttl_s(self) -> float:
        """``GPUHEDGE_RECEIPT_TTL_S`` alone (also Celery's result lifetime): an app that never
        runs a race is not refused for the race section's other variables."""
        return envvars.receipt_ttl_s(self.env)

    def race_shards(self, prefix: str, redis_url: str | None = None) -> RaceShards:
        """Where the races under ``prefix`` live (``GPUHEDGE_TIMER_NAMESPACE``,
        ``GPUHEDGE_RACE_SHARDS``), for a process that reads races (callers, the CLI):
        ``redis_url``, the Redis it was given, decides the count's default."""
        env = self.env if redis_url is None else {**self.env, envvars.REDIS_URL_VAR: redis_url}
        return RaceShards(prefix, self.race.timer_namespace, envvars.race_shards(env))

    @cached_property
    def pool_direct(self) -> bool:
        """``GPUHEDGE_POOL_DIRECT`` alone, for a caller whose app has no glue section."""
        return envvars.pool_direct(self.env)

    @cached_property
    def webhooks(self) -> WebhookSettings:
        """Provider webhooks: the public URL and the token secrets."""
        return WebhookSettings.from_env(self.env)

    @cached_property
    def signing(self) -> Signing | None:
        """Celery message signing (``GPUHEDGE_SECURITY_*``); None when it is off."""
        return Signing.from_env(self.env)

    @cached_property
    def janitor(self) -> JanitorSettings:
        return JanitorSettings.from_env(self.env)

    @cached_property
    def metrics_enabled(self) -> bool:
        """``GPUHEDGE_METRICS``: apart from the endpoint, whose port may be bad."""
        return envvars.metrics_enabled(self.env)

    @cached_property
    def metrics(self) -> MetricsSettings:
        """A worker's ``/metrics`` endpoint."""
        return MetricsSettings.from_env(self.env)

    @cached_property
    def runner_env(self) -> frozenset[str]:
        """More variable names a model command or model server inherits (run_context.py)."""
        return envvars.runner_env_names(self.env)

    @cached_property
    def probe_dir(self) -> str | None:
        """Bench only: where a coordination worker writes its Redis counts (bench/redis_probe)."""
        return envvars.probe_dir(self.env)

    @cached_property
    def probe_sites(self) -> bool:
        """Bench only: count each Redis round trip by its call site too."""
        return envvars.probe_sites(self.env)


_current: ProcessSettings | None = None
_current_lock = threading.Lock()


def current() -> ProcessSettings:
    """This process's settings, from its environment (read once, then kept)."""
    found = _current
    if found is None:
        with _current_lock:
            found = _current
            if found is None:
                found = _set(ProcessSettings.from_env())
    return found


def reload(environ: Mapping[str, str] | None = None) -> ProcessSettings:
    """Forget the kept settings and read them again, from ``environ`` (default: this process's
    environment). For tests that change the environment, and for a CLI's start."""
    with _current_lock:
        return _set(ProcessSettings.from_env(environ))


def _set(settings: ProcessSettings) -> ProcessSettings:
    global _current
    _current = settings
    return settings
