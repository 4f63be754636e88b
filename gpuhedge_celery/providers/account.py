"""What a provider can say about its account: who we are logged in as, and what it billed.

Two optional hooks on :class:`~gpuhedge_celery.providers.base.Provider`, each one read-only call
at most:

* ``login_check() -> LoginCheck``: one authenticated read (``gpuhedge-celery login-check``);
* ``reported_spend(since) -> SpendReport``: the spend the provider's own billing reports since
  a UTC time (``gpuhedge-celery costs``), or why it cannot say.

An adapter overrides them when its platform has such an API; the defaults say "unsupported" /
"unavailable". Neither may ever put a secret in its text: :func:`scrub` removes any given
secret from a line before it is shown.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

OK, FAILED, UNSUPPORTED = "ok", "failed", "unsupported"
AVAILABLE, UNAVAILABLE = "ok", "unavailable"
MAX_DETAIL = 300


@dataclass(frozen=True)
class LoginCheck:
    """One provider's login check: ``status`` ok, failed or unsupported; who; what was called."""

    provider: str
    status: str
    identity: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "status": self.status,
            "identity": self.identity,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class SpendReport:
    """What a provider's billing reports: ``usd`` from ``since`` to ``until`` (UTC epoch s), or
    why not.

    ``status`` is ``ok`` (``usd`` is the provider's figure) or ``unavailable`` (``detail``
    says why: no billing API, not supported by this adapter, the call failed).
    """

    provider: str
    status: str
    usd: float | None = None
    since: float | None = None
    until: float | None = None  # the end of what the figure covers (None: up to now)
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "status": self.status,
            "usd": self.usd,
            "since": self.since,
            "until": self.until,
            "detail": self.detail,
        }


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` on one line, shortened, with every secret (4+ characters) replaced."""
    line = " ".join(str(text).split())
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        line = line.replace(secret, "<redacted>")
    return line if len(line) <= MAX_DETAIL else line[: MAX_DETAIL - 3] + "..."
