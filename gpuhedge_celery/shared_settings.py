"""The settings every gpuhedge-celery process shares: the Redis URL, the key prefix, the config
file (the ``core`` section of :func:`gpuhedge_celery.settings.current`).

Apart from ``settings.py`` so that the sections built on it (the Celery glue's) need not import
the module that gathers every section. One Redis URL configures everything: broker, result
backend and the lease store (the broker can be RabbitMQ instead: ``GPUHEDGE_BROKER_URL``, see
``tasks/config.py``; a ``redis+cluster://`` store needs that broker, a Redis one, which then
keeps Celery's results too). ``rediss://`` and passwords in the URL work; ``repr`` hides the
password so settings can be logged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from . import envvars
from .envvars import DEFAULT_PREFIX, DEFAULT_REDIS_URL
from .errors import ConfigError
from .redis_url import (
    PLAIN_SCHEMES,
    is_cluster,
    is_sentinel,
    parse_cluster_url,
    parse_sentinel_url,
    redact_url,
)

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]+\Z")


def validate_redis_url(url: str, *, source: str = envvars.REDIS_URL_VAR) -> str:
    if is_sentinel(url):
        parse_sentinel_url(url, key=source)
        return url
    if is_cluster(url):
        parse_cluster_url(url, key=source)
        return url
    parts = urlsplit(url)
    if parts.scheme not in PLAIN_SCHEMES:
        raise ConfigError(
            "expected a redis://, rediss://, unix://, sentinel:// or redis+cluster:// URL, got "
            f"{redact_url(url)!r}",
            key=source,
        )
    return url


@dataclass(frozen=True)
class Settings:
    """Settings shared by every gpuhedge-celery process."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = DEFAULT_PREFIX
    config_path: str | None = None
    # replicas that must hold a race's winner and a budget reservation before either counts
    # (Redis WAIT); 0 trusts the primary alone, as a single Redis must
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_redis_url(self.redis_url)
        if not _PREFIX_RE.match(self.prefix):
            raise ConfigError(
                f"expected letters, digits, '_', '-' or '.', got {self.prefix!r}",
                key=envvars.PREFIX_VAR,
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
        :func:`~gpuhedge_celery.settings.current`); ``overrides`` that are not None win (the
        CLI's options)."""
        return cls(**envvars.core_values(os.environ if environ is None else environ, overrides))
