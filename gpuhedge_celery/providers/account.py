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

import errno
import socket
import ssl
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


def no_answer(what: str, error: BaseException, secrets: Iterable[str | None] = ()) -> str:
    """One line for a call that got no HTTP answer: ``what`` was called, where, and why (no
    route to the host, connection refused, TLS, a timeout, a name not found), never a secret."""
    host = ""
    try:  # an httpx error carries its request; the host and port say which server
        url = error.request.url  # type: ignore[attr-defined]
        host = f" to {url.host}:{url.port or (443 if url.scheme == 'https' else 80)}"
    except (AttributeError, RuntimeError):
        pass
    return scrub(f"{what}: no answer{host}: {no_answer_reason(error)}", secrets)


def no_answer_reason(error: BaseException) -> str:
    """Why a call got no answer, in words, then the exception's class: ``connection refused
    (nothing listens on that port) (ConnectError)``. Holds no URL (a URL may carry a secret)."""
    return f"{_why(error)} ({type(error).__name__})"


def _why(error: BaseException) -> str:
    """The first cause in ``error``'s chain that says why a connection failed, in words."""
    names = [type(e).__name__ for e in _chain(error)]
    for e in _chain(error):
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"TLS certificate not accepted: {e.verify_message or e.reason}"
        if isinstance(e, ssl.SSLError):
            return f"TLS handshake failed: {e.reason or e}"
        if isinstance(e, socket.gaierror):
            return f"host name not found ({e.strerror or e})"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused (nothing listens on that port)"
        if isinstance(e, ConnectionResetError):
            return "connection reset by the server"
        if isinstance(e, OSError) and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"host unreachable ({e.strerror})"
    if any("ConnectTimeout" in n or "PoolTimeout" in n for n in names):
        return "timed out connecting"
    if any("Timeout" in n for n in names) or any(
        isinstance(e, TimeoutError) for e in _chain(error)
    ):
        return "timed out waiting for the answer"
    text = str(error).strip()
    return text.splitlines()[0] if text else "the connection failed"


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen
