"""The ``cerebrium`` adapter: Cerebrium's async runs, completed by webhook (docs/providers.md).

- **submit** ``POST {api_url}/v4/{project}/{app}/{function}?async=true&webhookEndpoint=<url>``
  with the request as the body -> ``202 {"run_id"}``. The id comes back with the submit (safe
  under concurrency). Never retried: a lost or unreadable answer, or a 5xx, is "submit outcome
  unknown" (the race flags a leak). Needs webhooks on (``GPUHEDGE_WEBHOOK_URL``): without a
  receiver nothing would ever report the run's end, so the submit is refused, unsent.
- **status**: Cerebrium's run-status API does not reconcile async runs, so nothing is asked:
  a run is ``IN_PROGRESS`` until its webhook arrives (``reports_queue_state`` is false). The
  race's watch looks only at its cap: a run whose webhook never came ends there as TIMEOUT
  ("outcome unknown"), its cancel is sent, and the receipt flags it as a leak.
- **webhook**: Cerebrium forwards the function's response body (3 tries, at most 5 s apart,
  none after a 5xx): :meth:`webhook_result` makes it the attempt's COMPLETED result (the
  payload at ``payload``), or FAILED when the body is an error (``{"error": ...}``).
- **cancel** ``DELETE {rest_url}/v2/projects/{project}/apps/{app_id}/runs/{run_id}``: evidence
  "acknowledged" at best, never confirmed (no status to confirm it by); a running run may still
  finish and post its webhook, which the race then records.
- **login-check** ``GET {rest_url}/v2/projects/{project}/apps/{app_id}`` (read-only; what an ok
  proves: ``account_checks.cerebrium_login_check``); **costs**: "unavailable" (Cerebrium has no
  account-spend API).

Each submit and cancel sent is counted in the provider metrics (routes ``submit`` and
``cancel``, error kinds as the ``http`` adapter's); a status asks nothing and counts nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import orjson

from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from ..core.receipts import SUBMIT_OUTCOME_UNKNOWN, CancelReceipt, CancelScope, Evidence
from ..errors import ConfigError, ProviderError, ProviderProtocolError, SubmitError
from ..metrics import record as metrics
from . import account_checks
from .account import LoginCheck, SpendReport, no_answer_reason
from .base import Provider
from .bounded_read import failure_kind
from .cerebrium_spec import CerebriumSpec
from .httpspec import MissingField, get_path, substitute_env
from .options import Block

if TYPE_CHECKING:
    from ..config import ProviderConfig

NO_WEBHOOK = (
    "not sent: Cerebrium reports async runs only by webhook; set GPUHEDGE_WEBHOOK_URL "
    "and GPUHEDGE_WEBHOOK_SECRET and run `gpuhedge-celery webhooks`"
)
_MISSING = object()
NEVER_CAME = "outcome unknown: no webhook arrived by the cap (the run may still be billing)"


class CerebriumProvider(Provider):
    """One Cerebrium function, run asynchronously (see the module docstring)."""

    adapter = "cerebrium"
    reports_queue_state = False

    def __init__(
        self,
        name: str,
        spec: CerebriumSpec,
        *,
        env: Mapping[str, str] | None = None,
        transport: Any = None,
        **kwargs: Any,
    ):
        super().__init__(name, **kwargs)
        env = os.environ if env is None else env
        where = spec.where or f"providers.{name}.cerebrium"
        self.spec = spec

        def sub(value: str, key: str) -> str:
            return substitute_env(value, env, file=spec.file, key=f"{where}.{key}")

        self.project = sub(spec.project_id, "project_id")
        self.app = sub(spec.app, "app")
        self.function = sub(spec.function, "function")
        self.app_id = sub(spec.app_id, "app_id") if spec.app_id else f"{self.project}-{self.app}"
        self.api_url = sub(spec.api_url, "api_url").rstrip("/")
        self.rest_url = sub(spec.rest_url, "rest_url").rstrip("/")
        self._key = sub(spec.api_key, "api_key")
        rest = sub(spec.rest_token, "rest_token") if spec.rest_token else ""
        self._rest_key = rest or self._key  # empty (${VAR:-} unset): the inference key
        self._transport = transport
        self._client: httpx.Client | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CerebriumProvider(name={self.name!r}, function={self.function!r})"

    @classmethod
    def parse_options(cls, block: Block, *, time_scale: float | None = None) -> CerebriumSpec:
        return CerebriumSpec.from_block(block)

    @classmethod
    def from_config(cls, cfg: ProviderConfig, **kwargs: Any) -> CerebriumProvider:
        if not isinstance(cfg.spec, CerebriumSpec):
            raise ConfigError(
                "the cerebrium adapter needs a cerebrium block",
                file=cfg.source,
                key=f"providers.{cfg.name}.cerebrium",
            )
        kwargs.pop("ledger", None)
        kwargs.pop("limiter", None)
        return cls(
            cfg.name,
            cfg.spec,
            billed_rate_per_s=cfg.billed_rate_per_s,
            idle_billed_seconds=cfg.idle_billed_seconds,
            **kwargs,
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ the contract
    def submit(
        self, request: dict[str, Any], *, context: Mapping[str, str] | None = None
    ) -> JobHandle:
        url = (context or {}).get("url")
        if not url:
            raise SubmitError(self.name, NO_WEBHOOK)
        where = "submit POST /v4/{project}/{app}/{function}"
        target = (
            f"{self.api_url}/v4/{quote(self.project, safe='')}/{quote(self.app, safe='')}"
            f"/{quote(self.function, safe='')}?async=true"
            f"&webhookEndpoint={quote(url, safe='')}"
        )
        submitted_at = self.clock.now()
        try:
            response = self._http().post(
                target, content=orjson.dumps(request), headers={"content-type": "application/json"}
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            metrics.provider_call(self.name, "submit", failure_kind(e))
            raise SubmitError(self.name, f"{where}: not sent: {no_answer_reason(e)}") from None
        except httpx.HTTPError as e:
            metrics.provider_call(self.name, "submit", failure_kind(e))
            raise self._unknown(where, f"{type(e).__name__} after sending") from None
        code = response.status_code
        if code >= 400:
            metrics.provider_call(self.name, "submit", metrics.http_error_kind(code))
            if code >= 500:  # a gateway may answer 5xx for a run it started
                raise self._unknown(where, f"HTTP {code}")
            raise SubmitError(
                self.name, f"{where}: HTTP {code}: {self._snippet(response)} (not accepted)"
            )
        try:
            data = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            data = _MISSING
        run_id = data.get("run_id") if isinstance(data, dict) else None
        if not isinstance(run_id, str) or not run_id:
            metrics.provider_call(self.name, "submit", "protocol")
            bad = f"field 'run_id' is {run_id!r}"[:80]
            raise self._unknown(where, "answer is not JSON" if data is _MISSING else bad)
        metrics.provider_call(self.name, "submit")
        return JobHandle(self.name, run_id, submitted_at, extra={"app_id": self.app_id})

    def status(self, handle: JobHandle) -> JobState:
        """Nothing to ask (see the module docstring): running until its webhook says."""
        self.check_handle(handle)
        return JobState.IN_PROGRESS

    def result(self, handle: JobHandle, cap_s: float) -> AttemptResult:
        """Called at the cap only (a webhook brings the result itself): outcome unknown."""
        self.check_handle(handle)
        now = self.clock.now()
        deadline = self.deadline(handle, cap_s)
        if now < deadline:
            self.sleep(deadline - now)
        result = self.timeout_result(handle, cap_s, [])
        result.error = NEVER_CAME
        return result

    def webhook_result(self, handle: JobHandle, body: Any) -> AttemptResult:
        """The forwarded response body as the run's result."""
        self.check_handle(handle)
        wall_ms = self.elapsed_ms(handle)
        metrics = {"cost_usd_estimate": self.cost_usd(wall_ms / 1000.0)}
        try:
            payload = get_path(body, self.spec.payload) if self.spec.payload else body
        except MissingField:
            payload = _MISSING
        if isinstance(body, dict) and body.get("error") and (payload is _MISSING or not payload):
            error = self.scrub(" ".join(str(body["error"]).split()))[:300]
            events = [LifecycleEvent(wall_ms, "failed", "webhook")]
            return AttemptResult(
                self.name,
                handle.job_id,
                JobState.FAILED,
                wall_ms,
                None,
                metrics,
                events,
                f"run failed: {error}",
            )
        if payload is _MISSING:
            raise ProviderProtocolError(
                self.name,
                f"webhook (run {handle.job_id!r}): no field {self.spec.payload!r} in the body",
            )
        events = [LifecycleEvent(wall_ms, "completed", "webhook")]
        return AttemptResult(
            self.name, handle.job_id, JobState.COMPLETED, wall_ms, payload, metrics, events
        )

    def cancel(self, handle: JobHandle) -> CancelReceipt:
        """``DELETE .../runs/{run_id}``: acknowledged at best (nothing confirms it)."""
        self.check_handle(handle)
        receipt = CancelReceipt(provider=self.name, job_id=handle.job_id)
        app_id = str(handle.extra.get("app_id") or self.app_id)
        target = (
            f"{self.rest_url}/v2/projects/{quote(self.project, safe='')}/apps/"
            f"{quote(app_id, safe='')}/runs/{quote(handle.job_id, safe='')}"
        )
        receipt.cancel_sent_ms = self.now_ms()
        receipt.estimated_cost_usd = self.cost_usd(self.clock.now() - handle.submitted_at)
        try:
            response = self._http().delete(target)
        except httpx.HTTPError as e:
            metrics.provider_call(self.name, "cancel", failure_kind(e))
            receipt.note = f"cancel call failed: {no_answer_reason(e)}"
            return receipt
        code = response.status_code
        # a 3xx is no acknowledgement either: an error of kind http
        metrics.provider_call(
            self.name, "cancel", metrics.http_error_kind(code) if code >= 300 else None
        )
        if code >= 300:
            receipt.note = f"cancel: HTTP {response.status_code}: {self._snippet(response)}"
            return receipt
        receipt.cancel_ack_ms = self.now_ms()
        receipt.upgrade(Evidence.PROVIDER_ACK)
        receipt.scope = CancelScope.REQUEST
        receipt.note = (
            "acknowledged; Cerebrium cannot confirm an async run stopped (a running "
            "run may still finish and post its webhook)"
        )
        return receipt

    # --- account hooks (login-check, costs): see providers/account_checks.py ----------------

    def login_check(self) -> LoginCheck:
        return account_checks.cerebrium_login_check(self)

    def reported_spend(self, since: float) -> SpendReport:
        return account_checks.cerebrium_spend(self, since)

    # ------------------------------------------------------------------ internals
    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None or self._pid != os.getpid():  # a forked child: its own
                timeout = httpx.Timeout(
                    self.spec.read_timeout_s, connect=self.spec.connect_timeout_s
                )
                self._client = httpx.Client(
                    timeout=timeout,
                    transport=self._transport,
                    auth=_BearerByApi(f"{self.rest_url}/v2/", self._rest_key, self._key),
                )
                self._pid = os.getpid()
            return self._client

    def secrets(self) -> tuple[str, ...]:
        return (self._key, self._rest_key)

    def _snippet(self, response: httpx.Response) -> str:
        return self.scrub(" ".join(response.text[:160].split()))

    def _unknown(self, where: str, why: str) -> ProviderError:
        error = SubmitError(
            self.name,
            f"{where}: {SUBMIT_OUTCOME_UNKNOWN} ({why}): the run may "
            "exist without our knowing its id; not retried",
        )
        error.outcome_unknown = True  # type: ignore[attr-defined]
        return error


class _BearerByApi(httpx.Auth):
    """The management API's token on its URLs, the inference key on every other request."""

    def __init__(self, rest_prefix: str, rest_token: str, api_key: str):
        self.rest_prefix, self.rest_token, self.api_key = rest_prefix, rest_token, api_key

    def auth_flow(self, request: httpx.Request) -> Any:
        rest = str(request.url).startswith(self.rest_prefix)
        request.headers["authorization"] = f"Bearer {self.rest_token if rest else self.api_key}"
        yield request
