"""Webhook settings from the environment (read once per process, validated).

=================================  ==========  ===============================================
variable                           default     meaning
=================================  ==========  ===============================================
GPUHEDGE_WEBHOOK_URL               ""          the receiver's public base URL (``https://``,
                                               behind the TLS ingress; ``http://`` only on
                                               a loopback host); empty: webhooks off, every
                                               job is polled
GPUHEDGE_WEBHOOK_SECRET            ""          the HMAC key of the per-attempt tokens (at
                                               least 16 characters; required with a URL);
                                               the same on every worker and the receiver
GPUHEDGE_WEBHOOK_SECRET_PREVIOUS   ""          while rotating: the secret before, whose
                                               tokens the receiver still accepts (workers
                                               mint with GPUHEDGE_WEBHOOK_SECRET only)
GPUHEDGE_WEBHOOK_FALLBACK_S        30          with webhooks on, a job is polled only before
                                               its race's policy decisions and this often
GPUHEDGE_WEBHOOK_MAX_BYTES         4194304     a larger delivery body is refused (413)
=================================  ==========  ===============================================

The secret is kept out of ``repr`` and out of the Celery configuration (it is not a
:class:`~gpuhedge_celery.race.settings.RaceSettings` field, which ``inspect conf`` shows).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..envvars import env_number
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
        env = os.environ if environ is None else environ
        url = (env.get("GPUHEDGE_WEBHOOK_URL") or "").strip().rstrip("/")
        secret = env.get("GPUHEDGE_WEBHOOK_SECRET") or ""
        previous = env.get("GPUHEDGE_WEBHOOK_SECRET_PREVIOUS") or ""
        if url and not url.startswith(("https://", "http://")):
            raise ConfigError(
                f"expected an http(s):// URL, got {url!r}", key="GPUHEDGE_WEBHOOK_URL"
            )
        if url.startswith("http://") and not _loopback(url):
            raise ConfigError(
                "expected https:// (each attempt's URL is its credential, so it must not "
                f"cross a network in the clear; http:// only on a loopback host), got {url!r}",
                key="GPUHEDGE_WEBHOOK_URL",
            )
        if url and len(secret) < MIN_SECRET:
            raise ConfigError(
                f"needs at least {MIN_SECRET} characters when GPUHEDGE_WEBHOOK_URL is set",
                key="GPUHEDGE_WEBHOOK_SECRET",
            )
        if previous and len(previous) < MIN_SECRET:
            raise ConfigError(
                f"needs at least {MIN_SECRET} characters", key="GPUHEDGE_WEBHOOK_SECRET_PREVIOUS"
            )
        return cls(
            url=url,
            secret=secret,
            fallback_s=_number(env, "GPUHEDGE_WEBHOOK_FALLBACK_S", 30.0),
            max_bytes=int(_number(env, "GPUHEDGE_WEBHOOK_MAX_BYTES", 4 * 1024 * 1024)),
            previous_secret=previous,
        )


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    return env_number(
        env, name, default, cast=float, kind="a number", valid=lambda v: v > 0,
        bound="a positive number",
    )  # fmt: skip
