"""Process-wide settings read once from the environment (``GPUHEDGE_*``).

:func:`current` is this process's :class:`ProcessSettings`: one frozen object whose sections
(``core``, ``glue``, ``race``, ``webhooks``, ``janitor``, ``metrics``...) are each parsed and
validated on first use, then kept. Code takes the object (or a section) instead of reading
``os.environ``; only this module and ``envvars.py`` (the parsers) read ``GPUHEDGE_*``
variables. A test that changes the environment calls :func:`reload` (or builds
``ProcessSettings.from_env(env)`` from a mapping of its own). Every variable is listed once in
docs/configuration.md (*Environment variables*).

One Redis URL configures everything: broker, result backend and the lease store (the broker can
be RabbitMQ instead: ``GPUHEDGE_BROKER_URL``, see ``tasks/config.py``). ``rediss://`` and
passwords in the URL work; ``repr`` hides the password so settings can be logged.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from . import envvars
from .envvars import broker_prefix
from .errors import ConfigError

if TYPE_CHECKING:
    from .race.settings import RaceSettings
    from .tasks.config import GlueConfig
    from .tasks.message_signing import Signing
    from .webhooks.settings import WebhookSettings

__all__ = ["ProcessSettings", "Settings", "broker_prefix", "current", "redact_url", "reload"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "gpuhedge"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (for logs, errors and repr)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{user}:***@{host}{port}"
    return parts._replace(netloc=netloc).geturl()


def validate_redis_url(url: str, *, source: str = "GPUHEDGE_REDIS_URL") -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"expected a redis://, rediss:// or unix:// URL, got {redact_url(url)!r}", key=source
        )
    return url


@dataclass(frozen=True)
class Settings:
    """Settings shared by every gpuhedge-celery process."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX
    config_path: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_redis_url(self.redis_url)
        if not _PREFIX_RE.match(self.prefix):
            raise ConfigError(
                f"expected letters, digits, '_', '-' or '.', got {self.prefix!r}",
                key="GPUHEDGE_PREFIX",
            )

    def __repr__(self) -> str:
        return (
            f"Settings(redis_url={redact_url(self.redis_url)!r}, prefix={self.prefix!r}, "
            f"config_path={self.config_path!r})"
        )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: str | None
    ) -> Settings:
        """Read from ``environ`` now (this process's environment by default, not the cached
        :func:`current`); ``overrides`` that are not None win (the CLI's options)."""
        return envvars.read_core(os.environ if environ is None else environ, overrides)


@dataclass(frozen=True)
class JanitorSettings:
    """The janitor's ``GPUHEDGE_JANITOR_*`` settings (tasks/janitor.py), validated."""

    stale_s: float = 30.0
    limit: int = 100

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JanitorSettings:
        return envvars.read_janitor(os.environ if environ is None else environ)


@dataclass(frozen=True)
class MetricsSettings:
    """A worker's ``/metrics`` endpoint (metrics/exposition.py): ``port`` None serves none."""

    enabled: bool = True
    port: int | None = None
    addr: str = "127.0.0.1"


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
        return envvars.read_core(self.env, {})

    @cached_property
    def glue(self) -> GlueConfig:
        """The Celery side: broker, worker roles, the GPU worker's runner and health."""
        return envvars.read_glue(self.env)

    @cached_property
    def race(self) -> RaceSettings:
        """Distributed races: receipts, timers, launches, events, records, plugins."""
        return envvars.read_race(self.env)

    @cached_property
    def receipt_ttl_s(self) -> float:
        """``GPUHEDGE_RECEIPT_TTL_S`` alone (also Celery's result lifetime): an app that never
        runs a race is not refused for the race section's other variables."""
        return envvars.receipt_ttl_s(self.env)

    @cached_property
    def pool_direct(self) -> bool:
        """``GPUHEDGE_POOL_DIRECT`` alone, for a caller whose app has no glue section."""
        return envvars.pool_direct(self.env)

    @cached_property
    def webhooks(self) -> WebhookSettings:
        """Provider webhooks: the public URL and the token secrets."""
        return envvars.read_webhooks(self.env)

    @cached_property
    def signing(self) -> Signing | None:
        """Celery message signing (``GPUHEDGE_SECURITY_*``); None when it is off."""
        return envvars.read_signing(self.env)

    @cached_property
    def janitor(self) -> JanitorSettings:
        return envvars.read_janitor(self.env)

    @cached_property
    def metrics_enabled(self) -> bool:
        """``GPUHEDGE_METRICS``: apart from the endpoint, whose port may be bad."""
        return envvars.metrics_enabled(self.env)

    @cached_property
    def metrics(self) -> MetricsSettings:
        """A worker's ``/metrics`` endpoint."""
        return envvars.read_metrics(self.env)

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
