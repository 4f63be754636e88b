"""Process-wide settings read once from the environment (``GPUHEDGE_*``).

One Redis URL configures everything: broker, result backend and the lease store (the broker can
be RabbitMQ instead: ``GPUHEDGE_BROKER_URL``, see ``tasks/config.py``). ``rediss://`` and
passwords in the URL work; ``repr`` hides the password so settings can be logged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .errors import ConfigError

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


def broker_prefix(env: Mapping[str, str], prefix: str) -> str:
    """The prefix of Celery's own keys (queues, results, remote control): ``GPUHEDGE_BROKER_PREFIX``
    when it is set (to anything, "" included), else ``<GPUHEDGE_PREFIX>:`` for a prefix other
    than the default, so two deployments with their own prefixes never share queues; the
    default prefix keeps Celery's plain layout (what other Celery apps calling our tasks by
    name, and every deployment that never set a prefix, use)."""
    if "GPUHEDGE_BROKER_PREFIX" in env:
        return env["GPUHEDGE_BROKER_PREFIX"]
    return "" if prefix == DEFAULT_PREFIX else f"{prefix}:"


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
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: str | None) -> Settings:
        env = os.environ if environ is None else environ
        values = {
            "redis_url": env.get("GPUHEDGE_REDIS_URL") or DEFAULT_REDIS_URL,
            "prefix": env.get("GPUHEDGE_PREFIX") or DEFAULT_PREFIX,
            "config_path": env.get("GPUHEDGE_CONFIG") or None,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
