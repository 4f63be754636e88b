"""Webhook settings (the webhooks section of :func:`gpuhedge_celery.settings.current`).

Parsed from ``GPUHEDGE_WEBHOOK_*`` variables by :func:`gpuhedge_celery.envvars.webhook_values`;
each is described in docs/configuration.md (*Environment variables*).

The secret is kept out of ``repr`` and out of the Celery configuration (it is not a
:class:`~gpuhedge_celery.race.settings.RaceSettings` field, which ``inspect conf`` shows).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .. import envvars
from ..errors import ConfigError

MIN_SECRET = 16


@dataclass(frozen=True)
class WebhookSettings:
    url: str = ""
    secret: str = field(default="", repr=False)
    fallback_s: float = 30.0
    max_bytes: int = 4 * 1024 * 1024
    previous_secret: str = field(default="", repr=False)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The secrets whose tokens a delivery may carry: the current one first."""
        return tuple(s for s in (self.secret, self.previous_secret) if s)

    @property
    def on(self) -> bool:
        return bool(self.url and self.secret)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WebhookSettings:
        """Read and validate them from ``environ`` now (this process's environment by
        default); code running in a worker takes ``settings.current().webhooks`` instead."""
        values = envvars.webhook_values(os.environ if environ is None else environ)
        url, secret, previous = values["url"], values["secret"], values["previous_secret"]
        if url and not url.startswith(("https://", "http://")):
            raise ConfigError(
                f"expected an http(s):// URL, got {url!r}", key=envvars.WEBHOOK_URL_VAR
            )
        if url.startswith("http://") and not loopback(url):
            raise ConfigError(
                "expected https:// (each attempt's URL is its credential, so it must not "
                f"cross a network in the clear; http:// only on a loopback host), got {url!r}",
                key=envvars.WEBHOOK_URL_VAR,
            )
        if url and len(secret) < MIN_SECRET:
            raise ConfigError(
                f"needs at least {MIN_SECRET} characters when {envvars.WEBHOOK_URL_VAR} is set",
                key=envvars.WEBHOOK_SECRET_VAR,
            )
        if previous and len(previous) < MIN_SECRET:
            raise ConfigError(
                f"needs at least {MIN_SECRET} characters", key=envvars.WEBHOOK_PREVIOUS_VAR
            )
        return cls(**values)


def loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine (where ``http://`` is allowed)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
