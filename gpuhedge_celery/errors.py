"""The exception tree of gpuhedge-celery.

Every error the package raises on purpose derives from :class:`GpuHedgeError`, so a caller can
catch as coarsely or as finely as it needs::

    GpuHedgeError
    ├── ConfigError            bad YAML, unknown key, wrong type, unset ${ENV}
    │   └── PluginNotImported  a plugin's name, met where plugin code does not run (config check)
    ├── StoreError             anything about the Redis store
    │   ├── StoreUnavailable   Redis unreachable (connection refused, timeout, auth)
    │   └── NotificationsUnavailable  CONFIG forbidden: keyspace events cannot be enabled
    ├── LeaseError             lease rules
    │   ├── LeaseLost          release/renew by a holder whose token is no longer current
    │   ├── StaleToken         a GPU worker refused work carrying an older fencing token
    │   ├── UnknownPool        no such pool registered
    │   ├── EmptyPool          the pool exists but has no live GPU
    │   └── AcquireTimeout     no GPU became free before the caller's deadline
    ├── HandoffFailed          a leased GPU's job could not be published to its queue
    ├── ProviderError          provider adapters
    │   ├── SubmitError        the provider did not accept the job (or we cannot tell)
    │   ├── ProviderProtocolError  the provider answered something we cannot parse
    │   └── RateLimited        no call was made: the request budget (ours or the provider's)
    │                          allows the next one at ``retry_at``
    └── RaceFailed             a race ended without a valid result (carries its receipt)
        └── BudgetExceeded     ... because the budget refused an attempt it needed

Driver errors (redis-py, httpx) are translated at the boundary with ``raise ... from e`` so the
original is kept as ``__cause__``.

Every error keeps its constructor arguments in ``args`` (and its formatted text for ``str()``), so
Celery's JSON result backend, which rebuilds an exception as ``cls(*args)``, gives the caller the
same type with the same fields: ``pooled_infer.delay(...).get()`` raises a real ``UnknownPool``.
"""

from __future__ import annotations

from typing import Any


class GpuHedgeError(Exception):
    """Base class of every gpuhedge-celery error."""

    _text: str | None = None

    def _keep(self, text: str, *ctor_args: Any) -> None:
        """Show ``text`` but keep the constructor's arguments in ``args`` (JSON round trips)."""
        self._text = text
        self.args = ctor_args

    def __str__(self) -> str:
        text = self._text if self._text is not None else super().__str__()
        # One line, always: a message quoting bad input (a policy name, a YAML scalar, a
        # provider's reply) must not break a log line or a CLI's one-line error.
        return text.replace("\r", "\\r").replace("\n", "\\n")


class ConfigError(GpuHedgeError):
    """Invalid configuration; the message names the file, the key and what was expected."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file = file
        self.key = key
        where = ""
        if file and key:
            where = f"{file}: {key}: "
        elif file:
            where = f"{file}: "
        elif key:
            where = f"{key}: "
        super().__init__(f"{where}{message}")


class PluginNotImported(ConfigError):
    """A policy or adapter a plugin provides was needed where no plugin code runs (``config
    check``, ``config show``): not an error in the file, but nothing to check it against."""


class StoreError(GpuHedgeError):
    """A problem with the Redis store."""


class StoreUnavailable(StoreError):
    """Redis cannot be reached (refused, timed out, or authentication failed)."""


class NotificationsUnavailable(StoreError):
    """Keyspace notifications cannot be enabled (CONFIG is forbidden on managed Redis)."""


class LeaseError(GpuHedgeError):
    """A lease rule was violated."""


class LeaseLost(LeaseError):
    """The caller's lease is no longer current: it expired or another holder took the GPU."""

    def __init__(self, gpu_id: str, token: int, message: str | None = None):
        self.gpu_id = gpu_id
        self.token = token
        text = message or f"lease on GPU {gpu_id!r} with token {token} is no longer held"
        super().__init__(text)
        self._keep(text, gpu_id, token, message)


class StaleToken(LeaseError):
    """A GPU worker refused work because its fencing token is older than one already seen."""

    def __init__(self, gpu_id: str, token: int, current: int):
        self.gpu_id = gpu_id
        self.token = token
        self.current = current
        why = f"token {current} is newer" if current != token else "it ran other work already"
        text = f"GPU {gpu_id!r} refused fencing token {token}: {why}"
        super().__init__(text)
        self._keep(text, gpu_id, token, current)


class UnknownPool(LeaseError):
    """The named pool has no registered GPUs at all."""

    def __init__(self, pool: str):
        self.pool = pool
        text = f"unknown pool {pool!r}: no GPU is registered in it"
        super().__init__(text)
        self._keep(text, pool)


class EmptyPool(LeaseError):
    """The pool is known but none of its GPUs is on a live host."""

    def __init__(self, pool: str):
        self.pool = pool
        text = f"pool {pool!r} has no live GPU (every host stopped heartbeating)"
        super().__init__(text)
        self._keep(text, pool)


class AcquireTimeout(LeaseError):
    """No GPU of the pool became free before the caller's deadline."""


class HandoffFailed(GpuHedgeError):
    """A pooled request held a GPU's lease but its job could not be published to that GPU's
    queue, after every try; the lease was given back and the request failed explicitly."""

    def __init__(self, request_id: str, gpu_id: str, tries: int, cause: str):
        self.request_id, self.gpu_id, self.tries, self.cause = request_id, gpu_id, tries, cause
        self._keep(
            f"pooled request {request_id}: could not hand it to GPU {gpu_id}'s queue "
            f"({tries} tries, last: {cause}); its lease was given back, send it again",
            request_id,
            gpu_id,
            tries,
            cause,
        )


class RequestLost(GpuHedgeError):
    """A pooled request Redis no longer knows, with no result stored: its record and its broker
    message were lost together (a Redis restart that dropped its last writes). Send it again."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._keep(
            f"pooled request {request_id}: lost before any worker took it (Redis no longer "
            "knows it and no result was stored; a restart dropped its last writes); send it again",
            request_id,
        )


class ProviderError(GpuHedgeError):
    """A provider adapter failed."""

    def __init__(self, provider: str, message: str):
        self.provider = provider
        text = f"provider {provider!r}: {message}"
        super().__init__(text)
        self._keep(text, provider, message)


class SubmitError(ProviderError):
    """The provider did not accept the job."""


class ProviderProtocolError(ProviderError):
    """The provider's answer could not be parsed (missing field, malformed JSON)."""


class RateLimited(ProviderError):
    """No call was made: the request budget (the fleet's shared bucket, or the provider's own
    429 with a ``Retry-After``) allows the next one at ``retry_at`` (epoch seconds)."""

    #: the budget already gave this caller the token for ``retry_at`` (in-process only)
    reserved: bool = False

    def __init__(self, provider: str, message: str, retry_at: float = 0.0):
        self.retry_at = float(retry_at)
        super().__init__(provider, message)
        self._keep(str(self), provider, message, self.retry_at)


class RaceFailed(GpuHedgeError):
    """A race ended without a valid result. ``receipt`` holds the full race receipt (a dict);
    ``reason`` says why: ``no_valid_result``, or ``budget`` (see :class:`BudgetExceeded`).

    The message names every attempt and why it did not win (taken from the receipt), e.g.
    ``race R: no attempt returned a valid result [a1 sim-cheap (primary) COMPLETED, invalid:
    wav: near-silent | a2 sim-steady (hedge) FAILED: simulated job failure]``. ``args`` keep
    that full text, so the exception Celery rebuilds from them (even in an app that cannot
    import this class) says the same.
    """

    race_id: str  # set by the command that ran the race (commands/race.py), never by __init__

    def __init__(
        self, message: str, receipt: dict[str, Any] | None = None, reason: str = "no_valid_result"
    ):
        self.receipt = receipt or {}
        self.reason = reason
        details = attempt_reasons(self.receipt)
        text = message if not details or details in message else f"{message} [{details}]"
        super().__init__(text)
        self._keep(text, text, self.receipt, reason)


class BudgetExceeded(RaceFailed):
    """A race failed because the budget refused an attempt it needed (``reason`` ``budget``):
    its primary, or a hedge or fallback once nothing else was left. The receipt's attempts say
    which cap refused what."""

    def __init__(self, message: str, receipt: dict[str, Any] | None = None, reason: str = "budget"):
        super().__init__(message, receipt, reason)


def attempt_reasons(receipt: dict[str, Any]) -> str:
    """One line: each attempt of a race receipt, its final state and why it did not win."""
    parts = []
    for a in receipt.get("attempts") or []:
        if not isinstance(a, dict):
            continue
        state = str(a.get("state") or a.get("phase") or "?")
        if a.get("valid") is False and state == "COMPLETED":
            state += ", invalid"
        why = "; ".join(str(r) for r in a.get("reasons") or [] if r)
        text = f"{a.get('id', '?')} {a.get('provider', '?')} ({a.get('role', '?')}) {state}"
        parts.append(f"{text}: {why}" if why else text)
    return " ".join(" | ".join(parts).split())  # one line, whatever the reasons held
