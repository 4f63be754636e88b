"""Webhook settings (the webhooks section of :func:`gpuhedge_celery.settings.current`).

Parsed from ``GPUHEDGE_WEBHOOK_*`` variables by :func:`gpuhedge_celery.envvars.read_webhooks`;
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
        from ..envvars import read_webhooks

        return read_webhooks(os.environ if environ is None else environ)


def loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine (where ``http://`` is allowed)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
