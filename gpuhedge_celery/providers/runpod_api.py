"""Calls to one RunPod serverless endpoint: auth, timeouts, the fleet's budget, retries.

Every call takes a token from the endpoint's shared bucket for its route first
(:mod:`.ratelimit`), then sends. ``/status`` and ``/cancel`` are retried on 429, 5xx and
transport errors with exponential backoff (jittered), never sooner than the answer's
``Retry-After``, within the time the caller may block (``max_block_s``); a retry due later
becomes :class:`~gpuhedge_celery.errors.RateLimited` with ``retry_at``, so a status poll is
deferred instead of holding a timer thread (the race's watch blocks for nothing at all).
``/run`` is never retried: it takes no idempotency key, so a second POST could start a second
paid job. A submit whose answer was lost after the request
left (a read timeout, a dropped connection, a 5xx, a 2xx without a job id) is reported as
"submit outcome unknown" (the race flags it as a possible leak); one that provably never
reached RunPod (connect error, our budget, a 4xx) is a plain refusal.

Every request sent is counted in the provider metrics (``gpuhedge_provider_requests_total``
and, by kind, ``gpuhedge_provider_errors_total``; a 429 that is retried counts once per send)
under the route labels of the ``http`` adapter: ``/run`` as ``submit``, then ``status`` and
``cancel``. A call our own budget refused was never sent and is not counted.

The API key is sent as ``authorization`` and appears nowhere else: errors name calls by their
route template (``GET /status/{id}``), never by the resolved URL, and every error text is
scrubbed of the key.
"""

from __future__ import annotations

import email.utils
import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import quote

import httpx
import orjson

from ..core.receipts import SUBMIT_OUTCOME_UNKNOWN
from ..errors import ProviderError, ProviderProtocolError, RateLimited, SubmitError
from ..metrics import record as metrics
from ..secrets import scrub_secrets
from .account import no_answer_reason
from .bounded_read import BodyRefused, failure_kind, read_bounded
from .httpspec import substitute_env
from .ratelimit import Limiter, LocalLimiter, RouteLimit, default_limiter
from .runpod_spec import RunpodSpec

log = logging.getLogger(__name__)

RETRYABLE = frozenset({429, 500, 502, 503, 504})
METRIC_ROUTES = {"run": "submit", "status": "status", "cancel": "cancel"}  # the http adapter's
RESULTS_KEPT = "RunPod keeps a job's result for 30 min"


class JobUnknown(ProviderError):
    """RunPod answered 404 for a job: its result expired (kept 30 min) or it never existed, so
    its outcome can no longer be learnt."""


class RunpodApi:
    """One endpoint's HTTP client (per process: rebuilt after a fork)."""

    def __init__(
        self,
        provider: str,
        spec: RunpodSpec,
        *,
        env: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        limiter: Limiter | None = None,
        sleep: Any = time.sleep,
        clock: Any = time.time,
    ):
        env = os.environ if env is None else env
        where = spec.where or f"providers.{provider}.runpod"
        self.provider = provider
        self.spec = spec
        self.endpoint_id = substitute_env(
            spec.endpoint_id, env, file=spec.file, key=f"{where}.endpoint_id"
        )
        base = substitute_env(spec.base_url, env, file=spec.file, key=f"{where}.base_url")
        self._key = substitute_env(spec.api_key, env, file=spec.file, key=f"{where}.api_key")
        self.graphql_url = substitute_env(
            spec.graphql_url, env, file=spec.file, key=f"{where}.graphql_url"
        )
        self.webhook = (
            substitute_env(spec.webhook, env, file=spec.file, key=f"{where}.webhook")
            if spec.webhook
            else None
        )
        self.root = f"{base.rstrip('/')}/{quote(self.endpoint_id, safe='')}"
        self.scope = f"runpod:{self.endpoint_id}"
        self._transport = transport
        self._limiter = (
            limiter if limiter is not None else (None if spec.shared_limits else LocalLimiter())
        )
        self._sleep = sleep
        self._clock = clock
        self._waited = threading.local()  # per thread: the token wait of its last call
        self._client: httpx.Client | None = None
        self._client_pid: int | None = None
        self._lock = threading.Lock()

    @property
    def limiter(self) -> Limiter:
        if self._limiter is None:  # the shared one, built on first use (after any fork)
            self._limiter = default_limiter()
        return self._limiter

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ calls
    def call(
        self,
        route: str,
        method: str,
        label: str,
        *,
        job_id: str | None = None,
        body: Any = None,
        max_block_s: float = 0.0,
        reserve_s: float = 0.0,
        prepaid: bool = False,
        behind: bool = False,
    ) -> Any:
        """One call, as JSON.

        ``max_block_s``: how long budget waits and retries may block the caller.
        ``reserve_s``: a token due later than that but within ``reserve_s`` is taken now and
        the call raises ``RateLimited(reserved=True)``: the caller sends at its ``retry_at``
        with ``prepaid`` (that token), so deferred callers queue for distinct slots instead of
        all waking for the same one.
        ``behind``: take tokens behind the callers without it (they go first; see
        :mod:`.ratelimit`). :meth:`token_wait_s` is then how long this call waited for one.
        """
        where = f"{route} {method} {label}" + (f" (job {job_id!r})" if job_id else "")
        path = label.replace("{id}", quote(job_id, safe="")) if job_id else label
        limit = self.spec.limits[route]
        block_end = time.monotonic() + max_block_s
        attempt = 0
        while True:
            if not prepaid:
                left = max(0.0, block_end - time.monotonic())
                self._take(limit, where, left, reserve_s, behind)
            prepaid = False  # a retry takes its own token
            sent = self._send(route, method, path, where, body)
            metrics.provider_call(self.provider, METRIC_ROUTES.get(route, route), sent.kind)
            if sent.error is None:
                return sent.answer
            if not sent.retryable or attempt >= self.spec.retries.attempts:
                raise sent.error
            delay = self._backoff(attempt)
            if sent.retry_after is not None:
                delay = max(delay, sent.retry_after)
            if time.monotonic() + delay > block_end:
                # The retry is due later than this caller may block (a watch poll may not at
                # all: its thread serves every race's timers): it is handed back as a deferral.
                raise RateLimited(
                    self.provider,
                    f"{_text(sent.error)}; retry in {delay:.2f} s",
                    retry_at=self._clock() + delay,
                )
            self._sleep(delay)
            attempt += 1

    def token_wait_s(self) -> float:
        """How long this thread's last call waited for its rate-limit tokens."""
        return getattr(self._waited, "s", 0.0)

    def _take(
        self, limit: RouteLimit, where: str, block_s: float, reserve_s: float, behind: bool = False
    ) -> None:
        """A token for one request: waited for up to ``block_s``, reserved up to
        ``reserve_s`` ahead (raises, see :meth:`call`), else refused (raises). ``behind``:
        asked again at each time the limiter names until granted or ``block_s`` runs out."""
        started = self._clock()
        self._waited.s = 0.0  # a call refused its token waited for nothing it got
        grant = self.limiter.take(self.scope, limit, max(block_s, reserve_s), behind=behind)
        while behind and not grant.granted and self._clock() + grant.wait_s <= started + block_s:
            self._sleep(max(grant.wait_s, 0.001))
            left = max(0.0, started + block_s - self._clock())
            grant = self.limiter.take(self.scope, limit, left, behind=True)
        if behind:  # what the retries left of the caller's block
            block_s = max(0.0, started + block_s - self._clock())
        if grant.granted and grant.wait_s <= block_s:
            if grant.wait_s > 0:
                self._sleep(grant.wait_s)
            self._waited.s = self._clock() - started
            return
        budget = f"the fleet's budget for this endpoint ({limit.limit} per {limit.window_s:g} s)"
        at = self._clock() + grant.wait_s
        if grant.granted:
            text = f"{where}: deferred: {budget} reserved a slot in {grant.wait_s:.2f} s"
            error = RateLimited(self.provider, text, retry_at=at)
            error.reserved = True
            raise error
        text = f"{where}: not sent: {budget} allows the next in {grant.wait_s:.2f} s"
        raise RateLimited(self.provider, text, retry_at=at)

    def health(self, timeout_s: float = 2.0) -> Any:
        """``GET /health`` once, not retried (the caller caches it; see RunpodProvider)."""
        where = "health GET /health"
        timeout = httpx.Timeout(
            min(timeout_s, self.spec.read_timeout_s),
            connect=min(timeout_s, self.spec.connect_timeout_s),
        )
        try:
            code, content, _ = self._request("GET", self.root + "/health", None, timeout)
        except httpx.HTTPError as e:
            raise ProviderError(self.provider, f"{where}: {no_answer_reason(e)}") from None
        except BodyRefused as e:
            raise ProviderError(self.provider, f"{where}: {e}") from None
        if code >= 400:
            raise ProviderError(self.provider, f"{where}: HTTP {code}")
        return self._json(content, where, ProviderProtocolError)

    # ------------------------------------------------------------------ internals
    def _send(self, route: str, method: str, path: str, where: str, body: Any) -> _Sent:
        """Send once. Retryable: 429, 5xx and transport errors of ``/status`` and ``/cancel``."""
        submit = route == "run"
        try:
            code, content, answer_headers = self._request(method, self.root + path, body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            # Never connected: the request provably did not reach RunPod.
            cls = SubmitError if submit else ProviderError
            return _Sent(
                error=cls(self.provider, f"{where}: not sent: {no_answer_reason(e)}"),
                retryable=not submit,
                kind=failure_kind(e),
            )
        except httpx.HTTPError as e:
            if submit:
                why = f"{type(e).__name__} after sending"
                return _Sent(error=self.outcome_unknown(where, why), kind=failure_kind(e))
            detail = f"{where}: {type(e).__name__}: {self._scrub(str(e))[:120]}"
            return _Sent(
                error=ProviderError(self.provider, detail), retryable=True, kind=failure_kind(e)
            )
        except BodyRefused as e:  # an answer began, too big or too slow to read
            if submit:
                return _Sent(error=self.outcome_unknown(where, str(e)), kind=failure_kind(e))
            return _Sent(
                error=ProviderError(self.provider, f"{where}: {e}"),
                retryable=e.too_slow,
                kind=failure_kind(e),
            )
        if code < 400:
            try:
                return _Sent(answer=self._json(content, where, ProviderProtocolError))
            except ProviderProtocolError as e:
                if submit:  # it was accepted, but we cannot read its id
                    return _Sent(error=self.outcome_unknown(where, _text(e)), kind="protocol")
                return _Sent(error=e, kind="protocol")
        kind = metrics.http_error_kind(code)
        snippet = self._scrub(content[:160].decode("utf-8", "replace")).replace("\n", " ")
        text = f"{where}: HTTP {code}: {snippet}"
        if submit:
            if code >= 500:  # a gateway may answer 5xx for a job it created
                return _Sent(error=self.outcome_unknown(where, f"HTTP {code}"), kind=kind)
            return _Sent(error=SubmitError(self.provider, f"{text} (not accepted)"), kind=kind)
        if code == 404:
            return _Sent(
                error=JobUnknown(
                    self.provider,
                    f"{where}: HTTP 404: the job is unknown to RunPod (expired or "
                    f"never existed; {RESULTS_KEPT}): outcome unknown",
                ),
                kind=kind,
            )
        after = _retry_after(answer_headers.get("retry-after"), self._clock())
        if code == 429:
            error = RateLimited(self.provider, text, retry_at=self._clock() + (after or 0.0))
            return _Sent(error=error, retryable=True, retry_after=after, kind=kind)
        return _Sent(
            error=ProviderError(self.provider, text),
            retryable=code in RETRYABLE,
            retry_after=after,
            kind=kind,
        )

    def outcome_unknown(self, where: str, why: str) -> SubmitError:
        return SubmitError(
            self.provider,
            f"{where}: {SUBMIT_OUTCOME_UNKNOWN} ({why}): the job may exist "
            "without our knowing its id; not retried (/run takes no idempotency key)",
        )

    def _request(
        self, method: str, url: str, body: Any, timeout: httpx.Timeout | None = None
    ) -> tuple[int, bytes, httpx.Headers]:
        """Send once; the status, the body (read within ``read_s`` in all, at most
        ``max_response_bytes``: :func:`.bounded_read.read_bounded`) and the headers."""
        content = None if body is None else orjson.dumps(body)
        headers = _JSON if body is not None else None
        # a timeout built here always has its read part
        read_s = self.spec.read_timeout_s if timeout is None else cast(float, timeout.read)
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        with self._http().stream(
            method, url, content=content, headers=headers, **extra
        ) as response:
            data = read_bounded(response, limit=self.spec.max_response_bytes, read_s=read_s)
            return response.status_code, data, response.headers

    def _json(self, content: bytes, where: str, cls: type[ProviderError]) -> Any:
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError:
            snippet = self._scrub(content[:60].decode("utf-8", "replace")).replace("\n", " ")
            raise cls(self.provider, f"{where}: response is not JSON: {snippet!r}") from None

    def _backoff(self, attempt: int) -> float:
        r = self.spec.retries
        return min(r.max_backoff_s, r.backoff_s * (2**attempt)) * random.uniform(0.5, 1.0)

    def _http(self) -> httpx.Client:
        # a forked Celery worker must not share its parent's sockets
        if self._client is None or self._client_pid != os.getpid():
            with self._lock:
                if self._client is None or self._client_pid != os.getpid():
                    timeout = httpx.Timeout(
                        self.spec.read_timeout_s, connect=self.spec.connect_timeout_s
                    )
                    self._client = httpx.Client(
                        headers={"authorization": self._key},
                        timeout=timeout,
                        transport=self._transport,
                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
                    )
                    self._client_pid = os.getpid()
        return self._client

    def _scrub(self, text: str) -> str:
        return scrub_secrets(text, (self._key,))


_JSON = {"content-type": "application/json"}


class _Sent:
    """One send's outcome: the answer, or the error, whether to retry, RunPod's wait, and
    the error's kind for the metrics (None: a success)."""

    __slots__ = ("answer", "error", "retryable", "retry_after", "kind")

    def __init__(
        self,
        answer: Any = None,
        error: ProviderError | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
        kind: str | None = None,
    ):
        self.answer, self.error = answer, error
        self.retryable, self.retry_after, self.kind = retryable, retry_after, kind


def _text(error: Exception) -> str:
    """An error's text without the ``provider 'x': `` prefix."""
    return str(error).split(": ", 1)[-1]


def _retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)
