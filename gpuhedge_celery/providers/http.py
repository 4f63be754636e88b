"""The ``http`` adapter: any submit/status/cancel job API described in YAML (RunPod-shaped).

Rules it keeps:

- every request has explicit connect/read timeouts, the read timeout bounds the whole response
  (a server that drips a byte at a time is cut off, not waited on for ever), a body larger than
  ``max_response_bytes`` is refused as it streams in, and a poll inside ``result`` never waits
  past the caller's cap;
- job ids are percent-encoded into URLs, so ids holding ``/`` or ``?`` address the right job;
- a cancel counts as done only when a status poll shows a terminal state within
  ``cancel_confirm_s``; the cancel call's own 200 (or its reply's "CANCELLED") is only an
  acknowledgement, and a job that never reaches terminal gets a *leaked* receipt;
- HTTP and JSON problems become :class:`~gpuhedge_celery.errors.ProviderError` subclasses that
  name the provider, the call (as its URL template) and the field; header values (API keys)
  never appear in errors, receipts or ``repr``.

``submit`` and ``status`` raise on trouble; ``result`` and ``cancel`` never do: they report
what they saw (``FAILED`` after ``max_poll_errors`` failed polls in a row, ``TIMEOUT`` at the
cap, a leaked receipt when the cancel cannot be confirmed).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import httpx

from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from ..core.receipts import SUBMIT_OUTCOME_UNKNOWN, CancelReceipt, CancelScope, Evidence
from ..errors import ConfigError, ProviderError, ProviderProtocolError, SubmitError
from ..metrics import record as metrics
from ..secrets import SECRET_NAME
from . import account_checks
from .account import LoginCheck, SpendReport
from .base import Provider, believable_ms, cancel_note
from .bounded_read import BodyRefused, failure_kind, read_bounded
from .failed_result import failed_result
from .httpspec import (
    Endpoint,
    HttpSpec,
    MissingField,
    env_names,
    fill_url,
    get_path,
    render,
    substitute_env,
)
from .options import Block

if TYPE_CHECKING:
    from .provider_config import ProviderConfig


log = logging.getLogger(__name__)


class HttpProvider(Provider):
    """A provider reached over a JSON job API; everything about the API comes from ``spec``."""

    adapter = "http"

    def __init__(
        self,
        name: str,
        spec: HttpSpec,
        *,
        env: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        **kwargs: Any,
    ):
        super().__init__(name, **kwargs)
        self.spec = spec
        env = os.environ if env is None else env
        where = spec.where or f"providers.{name}.http"
        self._base_url = substitute_env(spec.base_url, env, file=spec.file, key=f"{where}.base_url")
        self._headers = {
            k: substitute_env(v, env, file=spec.file, key=f"{where}.headers.{k}")
            for k, v in spec.headers.items()
        }
        self._urls = {
            op: substitute_env(ep.url, env, file=spec.file, key=f"{where}.{op}.url")
            for op, ep in self._endpoints().items()
        }
        # header values, and any ${VAR} in a URL whose name says it is a credential
        urls = (spec.base_url, *(ep.url for ep in self._endpoints().values()))
        in_urls = [env.get(n, "") for u in urls for n in env_names(u) if SECRET_NAME.search(n)]
        self._secrets = (*self._headers.values(), *in_urls)
        self._transport = transport
        self._client: httpx.Client | None = None
        self._client_pid: int | None = None

    def __repr__(self) -> str:
        return f"HttpProvider(name={self.name!r}, headers=<{', '.join(sorted(self._headers))}>)"

    @property
    def reports_queue_state(self) -> bool:  # type: ignore[override]
        return self.spec.reports_queue_state

    @classmethod
    def parse_options(cls, block: Block, *, time_scale: float | None = None) -> HttpSpec:
        return HttpSpec.from_block(block, time_scale=time_scale)

    @classmethod
    def from_config(cls, cfg: ProviderConfig, **kwargs: Any) -> HttpProvider:
        if not isinstance(cfg.spec, HttpSpec):
            raise ConfigError(
                "the http adapter needs an http block",
                file=cfg.source,
                key=f"providers.{cfg.name}.http",
            )
        return cls(
            cfg.name,
            cfg.spec,
            billed_rate_per_s=cfg.billed_rate_per_s,
            idle_billed_seconds=cfg.idle_billed_seconds,
            **kwargs,
        )

    def close(self) -> None:
        """Close the pooled HTTP connections (a new client is made on next use)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- contract ---------------------------------------------------------------------------

    def submit(self, request: dict[str, Any]) -> JobHandle:
        """POST the request; the handle's time is taken before sending (it bounds the cap)."""
        submitted_at = self.clock.now()
        try:
            body = render(self.spec.submit.body, request)
        except KeyError as e:
            raise SubmitError(self.name, f"cannot build the submit body: {e.args[0]}") from None
        data = self._call("submit", self.spec.submit, body=body, error_cls=SubmitError)
        job_id = self._field(data, "submit", self.spec.submit, "job_id", self.spec.submit.job_id)
        if not isinstance(job_id, (str, int)) or job_id == "":
            raise ProviderProtocolError(
                self.name,
                f"submit {self.spec.submit.label}: field "
                f"{self.spec.submit.job_id!r} is not a job id: {job_id!r}",
            )
        return JobHandle(self.name, str(job_id), submitted_at)

    def status(self, handle: JobHandle) -> JobState:
        """One status call, mapped through ``state_map`` (unmapped strings are UNKNOWN)."""
        return self._status(handle)[0]

    def result(self, handle: JobHandle, cap_s: float) -> AttemptResult:
        """Poll status until terminal or the cap; fetch the payload of a completed job."""
        self.check_handle(handle)
        deadline = self.deadline(handle, cap_s)
        events: list[LifecycleEvent] = []
        last: JobState | None = None
        errors = 0
        while True:
            remaining = deadline - self.clock.now()
            try:
                state, data = self._status(handle, max_wait_s=remaining)
                errors = 0
            except ProviderError as e:
                errors += 1
                if errors >= self.spec.max_poll_errors:
                    return failed_result(
                        self, handle, events, f"{e} ({errors} failed polls in a row)"
                    )
            else:
                if state is not last:
                    events.append(LifecycleEvent(self.elapsed_ms(handle), state.value.lower()))
                    last = state
                if state.terminal:
                    return self._terminal(handle, state, data, events)
            now = self.clock.now()
            if now >= deadline:
                return self.timeout_result(handle, cap_s, events)
            self.sleep(min(self.spec.poll_interval_s, deadline - now))

    def cancel(self, handle: JobHandle) -> CancelReceipt:
        """Native cancel, then poll status to a terminal state within ``cancel_confirm_s``."""
        self.check_handle(handle)
        receipt = CancelReceipt(provider=self.name, job_id=handle.job_id)
        notes: list[str] = []
        try:
            before, data = self._status(handle)
        except ProviderError as e:
            before, data = None, None
            notes.append(f"pre-cancel status failed: {e}")
        if before is not None and before.terminal:
            receipt.was_running = False
            receipt.cancel_sent_ms = self.now_ms()
            self._confirm(receipt, handle, before, data, queued=False)
            receipt.scope = CancelScope.UNKNOWN  # nothing was stopped
            receipt.note = f"already {before} before the cancel; nothing to stop"
            return receipt
        if self.spec.reports_queue_state and before in (JobState.QUEUED, JobState.IN_PROGRESS):
            receipt.was_running = before is JobState.IN_PROGRESS
        refused = ""  # the cancel call's own failure: kept whatever the confirming reads add
        receipt.cancel_sent_ms = self.now_ms()
        try:
            self._call("cancel", self.spec.cancel, handle=handle)
            receipt.cancel_ack_ms = self.now_ms()
            receipt.upgrade(Evidence.PROVIDER_ACK)
        except ProviderError as e:
            refused = f"cancel call failed: {e}"
        window_end = self.clock.now() + self.spec.cancel_confirm_s
        while True:
            try:
                state, data = self._status(handle)
                if state.terminal:
                    self._confirm(receipt, handle, state, data, queued=before is JobState.QUEUED)
                    break
            except ProviderError as e:
                notes.append(f"confirming status failed: {e}")
            now = self.clock.now()
            if now >= window_end:
                notes.append(
                    f"no terminal state within {self.spec.cancel_confirm_s:g} s of the cancel"
                )
                receipt.estimated_cost_usd = self.cost_usd(now - handle.submitted_at)
                break
            self.sleep(min(self.spec.poll_interval_s, window_end - now))
        receipt.note = cancel_note(refused, notes)
        return receipt

    # --- account hooks (login-check, costs): see providers/account_checks.py ----------------

    def login_check(self) -> LoginCheck:
        return account_checks.http_login_check(self)

    def reported_spend(self, since: float) -> SpendReport:
        return account_checks.http_spend(self, since)

    # --- internals --------------------------------------------------------------------------

    def _endpoints(self) -> dict[str, Endpoint]:
        ops = {"submit": self.spec.submit, "status": self.spec.status, "cancel": self.spec.cancel}
        if self.spec.result is not None:
            ops["result"] = self.spec.result
        return ops

    def _client_for_pid(self) -> httpx.Client:
        # a forked Celery worker must not share its parent's sockets
        if self._client is None or self._client_pid != os.getpid():
            timeout = httpx.Timeout(self.spec.read_timeout_s, connect=self.spec.connect_timeout_s)
            self._client = httpx.Client(
                headers=self._headers, timeout=timeout, transport=self._transport
            )
            self._client_pid = os.getpid()
        return self._client

    def _url(self, op: str, job_id: str | None) -> str:
        url = fill_url(self._urls[op], job_id)
        return url if url.startswith(("http://", "https://")) else self._base_url + url

    def secrets(self) -> tuple[str, ...]:
        return self._secrets

    def _call(
        self,
        op: str,
        endpoint: Endpoint,
        *,
        handle: JobHandle | None = None,
        body: Any = None,
        max_wait_s: float | None = None,
        error_cls: type[ProviderError] = ProviderError,
    ) -> Any:
        """Make one call and return its parsed JSON, translating every failure to one line."""
        job_id = handle.job_id if handle else None
        if handle is not None:
            self.check_handle(handle)
            if endpoint.body is not None:
                body = render(endpoint.body, {}, job_id)
        timeout = None
        if max_wait_s is not None:
            read = max(0.05, min(self.spec.read_timeout_s, max_wait_s))
            timeout = httpx.Timeout(read, connect=min(self.spec.connect_timeout_s, read))
        where = f"{op} {endpoint.label}" + (f" (job {job_id!r})" if job_id else "")
        read_s = self.spec.read_timeout_s if timeout is None else cast(float, timeout.read)
        extra: dict[str, Any] = {"timeout": timeout} if timeout else {}
        try:
            with self._client_for_pid().stream(
                endpoint.method,
                self._url(op, job_id),
                json=body,
                **extra,
            ) as response:
                content = self._read_body(response, read_s, where, error_cls, op)
        except httpx.TimeoutException as e:
            metrics.provider_call(self.name, op, "timeout")
            hint = (
                f"; {SUBMIT_OUTCOME_UNKNOWN}: the job may exist without our knowing its id"
                if op == "submit"
                else ""
            )
            raise error_cls(self.name, f"{where}: timed out ({type(e).__name__}){hint}") from None
        except httpx.HTTPError as e:
            metrics.provider_call(self.name, op, "connection")
            detail = self.scrub(str(e))[:200]
            raise error_cls(self.name, f"{where}: {type(e).__name__}: {detail}") from None
        if response.status_code >= 400:
            metrics.provider_call(self.name, op, metrics.http_error_kind(response.status_code))
            text = content[:200].decode("utf-8", "replace")
            snippet = self.scrub(text).replace("\n", " ")
            raise error_cls(self.name, f"{where}: HTTP {response.status_code}: {snippet}")
        if not content and op == "cancel":
            metrics.provider_call(self.name, op)
            return {}
        try:
            data = json.loads(content)
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deep
            metrics.provider_call(self.name, op, "protocol")
            text = content[:80].decode("utf-8", "replace")
            snippet = self.scrub(text).replace("\n", " ")
            why = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
            raise ProviderProtocolError(
                self.name, f"{where}: response is not JSON ({why}): {snippet!r}"
            ) from None
        metrics.provider_call(self.name, op)
        return data

    def _read_body(
        self,
        response: httpx.Response,
        read_s: float,
        where: str,
        error_cls: type[ProviderError],
        op: str,
    ) -> bytes:
        """The response body, read within ``read_s`` in all and at most ``max_response_bytes``
        long (see :mod:`.bounded_read`); a refused body is counted in the provider metrics
        (``timeout`` when too slow, ``protocol`` when too big)."""
        try:
            return read_bounded(response, limit=self.spec.max_response_bytes, read_s=read_s)
        except BodyRefused as e:
            metrics.provider_call(self.name, op, failure_kind(e))
            raise error_cls(self.name, f"{where}: {e}") from None

    def _field(self, data: Any, op: str, endpoint: Endpoint, what: str, path: str | None) -> Any:
        assert path is not None
        try:
            return get_path(data, path)
        except MissingField:
            raise ProviderProtocolError(
                self.name, f"{op} {endpoint.label}: response has no field {path!r} ({what})"
            ) from None

    def _status(self, handle: JobHandle, max_wait_s: float | None = None) -> tuple[JobState, Any]:
        ep = self.spec.status
        data = self._call("status", ep, handle=handle, max_wait_s=max_wait_s)
        state = self.spec.map_state(self._field(data, "status", ep, "state", ep.state))
        if state is JobState.QUEUED and not self.spec.reports_queue_state:
            state = JobState.IN_PROGRESS
        return state, data

    def _metrics(self, data: Any, endpoint: Endpoint) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        for name, path in endpoint.metrics.items():
            try:  # metrics are optional extras: a missing one is simply not reported
                metrics[name] = get_path(data, path)
            except MissingField:
                continue
        return metrics

    def _terminal(
        self, handle: JobHandle, state: JobState, data: Any, events: list[LifecycleEvent]
    ) -> AttemptResult:
        wall_ms = self.elapsed_ms(handle)
        status_ep = self.spec.status
        metrics = self._metrics(data, status_ep)
        payload, error = None, None
        source, source_ep, op = data, status_ep, "status"
        try:
            if state is JobState.COMPLETED and self.spec.result is not None:
                source_ep, op = self.spec.result, "result"
                source = self._call("result", source_ep, handle=handle)
                metrics.update(self._metrics(source, source_ep))
            if state is JobState.COMPLETED and source_ep.payload:
                payload = self._field(source, op, source_ep, "payload", source_ep.payload)
        except ProviderError as e:
            return failed_result(self, handle, events, str(e), metrics)
        if state is not JobState.COMPLETED and source_ep.error:
            try:
                error = self.scrub(str(get_path(source, source_ep.error)))
            except MissingField:
                error = None
        if "execution_ms" in metrics and not believable_ms(metrics["execution_ms"]):
            if isinstance(metrics["execution_ms"], (int, float)):  # a number no job ran: dropped
                log.warning(
                    "provider %r: %s %s: execution_ms %r is not believable; ignored",
                    self.name,
                    op,
                    source_ep.label,
                    metrics["execution_ms"],
                )
            del metrics["execution_ms"]
        if "execution_ms" in metrics:
            metrics["cost_usd"] = self.cost_usd(metrics["execution_ms"] / 1000.0)
        return AttemptResult(
            self.name, handle.job_id, state, wall_ms, payload, metrics, events, error
        )

    def _confirm(
        self, receipt: CancelReceipt, handle: JobHandle, state: JobState, data: Any, queued: bool
    ) -> None:
        receipt.confirm_terminal(state, self.now_ms())
        metrics = self._metrics(data, self.spec.status)
        execution_ms = metrics.get("execution_ms")
        if execution_ms is not None and not believable_ms(execution_ms):
            execution_ms = None  # a figure no job could have run is never priced
        if isinstance(execution_ms, (int, float)) and not isinstance(execution_ms, bool):
            receipt.execution_ms_before_cancel = float(execution_ms)
            receipt.reconciled_cost_usd = self.cost_usd(execution_ms / 1000.0)
        # An execution time proves nothing about billing by itself; only an API whose terminal
        # states are documented to end billing (``terminal_stops_billing``) lets this terminal
        # state, observed by a status poll, confirm it.
        receipt.billing_stop_confirmed = self.spec.terminal_stops_billing
        ran = isinstance(execution_ms, (int, float)) and execution_ms > 0
        if queued and state is JobState.CANCELLED and not ran:
            receipt.scope = CancelScope.QUEUED_JOB
            receipt.estimated_cost_usd = 0.0
        else:
            receipt.scope = CancelScope(self.spec.cancel_scope)
            terminal_ms = cast(float, receipt.terminal_ms)  # set by confirm_terminal above
            elapsed_s = terminal_ms / 1000.0 - handle.submitted_at
            receipt.estimated_cost_usd = self.cost_usd(elapsed_s)  # upper bound: queue included
