"""The ``modal`` adapter: a deployed Modal function reached through the Python SDK.

Install with ``pip install 'gpuhedge-celery[modal]'``; the SDK is imported only when a modal
provider is first used (:mod:`gpuhedge_celery.providers.modal_sdk` is the one place).

How the contract maps onto Modal (see docs/providers.md#modal):

- ``submit``: ``Function.from_name(app, function).spawn(request)`` (or a class method), the
  request as its one positional argument; the ``FunctionCall``'s ``object_id`` is the job id.
- ``status``: ``FunctionCall.from_id(id).get(timeout=0)``: not ready is ``IN_PROGRESS``
  (Modal never tells queued from running, so ``reports_queue_state`` is False), an output is
  ``COMPLETED``, a remote error ``FAILED``; an expired output (no output, no unfinished
  input) ends the job as ``FAILED`` with its outcome unknown.
- ``cancel``: ``FunctionCall.cancel()`` cancels the input (never its container). Its evidence
  is the acknowledgement; only a later poll that shows the input ended confirms it. Modal bills
  the container, which idles on until scale-down: billing stop is never confirmed.

Every SDK call runs on this provider's few SDK threads and is waited for at most its timeout
(``timeouts`` in the block): an overrun is a ``ProviderError`` for a poll, and for a spawn a
``SubmitError`` that says the outcome is unknown (a spawn that answers later is cancelled on
the spot). So a hung SDK call never holds a race's timer or cancel thread past its bound.

Every SDK call that ran is counted in the provider metrics under the route it serves, as the
``http`` adapter's: a spawn is ``submit``, a poll ``status``, a cancel ``cancel``. Modal
answers no HTTP status: a call over its timeout is a ``timeout``, an SDK error ``rejected``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from ..core.receipts import CancelReceipt, CancelScope, Evidence
from ..errors import ConfigError, ProviderError, ProviderProtocolError, SubmitError
from ..metrics import record as metrics
from . import account_checks
from .account import LoginCheck, SpendReport
from .base import Provider, cancel_note
from .httpspec import MissingField, get_path
from .modal_sdk import (
    COMPLETED,
    EXPIRED,
    FAILED,
    PENDING,
    BoundedCalls,
    ModalClient,
    ModalSdkError,
    Outcome,
    SdkCallTimeout,
    describe,
)
from .modal_spec import ModalSpec
from .options import Block

if TYPE_CHECKING:
    from ..config import ProviderConfig

log = logging.getLogger(__name__)

#: the least time the last poll of ``result`` may take, even at the cap (one SDK round trip)
MIN_POLL_S = 0.25
#: environment variables the SDK authenticates with: never shown in errors or receipts
TOKEN_ENV = ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")
OUTCOME_UNKNOWN = "outcome unknown: Modal has no output and no unfinished input for this call"
IDLE_NOTE = "the container idles until Modal scales it down (billed)"


class ModalProvider(Provider):
    """A Modal function (or class method) spawned per request; see the module docstring."""

    adapter = "modal"
    reports_queue_state = False  # FunctionCall.get only says "not ready"

    def __init__(
        self,
        name: str,
        spec: ModalSpec,
        *,
        client: ModalClient | None = None,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ):
        super().__init__(name, **kwargs)
        env = os.environ if env is None else env
        self.spec = spec
        self.target = spec.resolved_target(env)
        self.client: ModalClient = client if client is not None else spec.make_client(env)
        self.calls = BoundedCalls(spec.sdk_threads, name=f"gpuhedge-modal-{name}")
        # the SDK reads its tokens from the process environment: scrub them from every text
        tokens = [source.get(k) for k in TOKEN_ENV for source in (os.environ, env)]
        self._secrets = sorted({v for v in tokens if v and len(v) >= 4}, key=len, reverse=True)

    def __repr__(self) -> str:
        return f"ModalProvider(name={self.name!r}, target={self.target.label!r})"

    @classmethod
    def parse_options(cls, block: Block, *, time_scale: float | None = None) -> ModalSpec:
        return ModalSpec.from_block(block)

    @classmethod
    def from_config(cls, cfg: ProviderConfig, **kwargs: Any) -> ModalProvider:
        if not isinstance(cfg.spec, ModalSpec):
            raise ConfigError(
                "the modal adapter needs a modal block",
                file=cfg.source,
                key=f"providers.{cfg.name}.modal",
            )
        keep = {k: kwargs[k] for k in ("clock", "sleep", "client", "env") if k in kwargs}
        return cls(
            cfg.name,
            cfg.spec,
            billed_rate_per_s=cfg.billed_rate_per_s,
            idle_billed_seconds=cfg.idle_billed_seconds,
            **keep,
        )

    # --- contract ---------------------------------------------------------------------------

    def submit(self, request: dict[str, Any]) -> JobHandle:
        """Spawn one call; the handle's time is taken before the spawn (it bounds the cap)."""
        submitted_at = self.clock.now()
        target, label = self.target, self.target.label
        timeout = self.spec.spawn_timeout_s
        try:
            call_id = self._call(
                "submit",
                lambda: self.client.spawn(target, request),
                timeout,
                "spawn",
                self._reap_late,
            )
        except SdkCallTimeout as e:
            if e.started:
                unknown = SubmitError(
                    self.name,
                    f"submit outcome unknown: spawn of {label} did not answer within "
                    f"{timeout:g} s; a call may exist without our knowing its id (it is "
                    "cancelled if its id comes later)",
                )
                unknown.outcome_unknown = True  # type: ignore[attr-defined] # the race: a leak
                raise unknown from None
            raise SubmitError(self.name, f"spawn of {label}: {e}; nothing was submitted") from None
        except ConfigError:
            raise
        except Exception as e:  # ModalSdkError, or a seam that raised something else
            raise SubmitError(self.name, self.scrub(_text(e))) from None
        if not isinstance(call_id, str) or not call_id:
            metrics.provider_call(self.name, "submit", "protocol")
            raise ProviderProtocolError(self.name, f"spawn of {label} gave no call id: {call_id!r}")
        metrics.provider_call(self.name, "submit")
        return JobHandle(self.name, call_id, submitted_at)

    def status(self, handle: JobHandle) -> JobState:
        """One non-blocking poll (``IN_PROGRESS`` until the call has an outcome)."""
        self.check_handle(handle)
        return _state(self._poll(handle.job_id, self.spec.poll_timeout_s))

    def result(self, handle: JobHandle, cap_s: float) -> AttemptResult:
        """Poll until the call has an outcome or the cap; never raises for a failed poll."""
        self.check_handle(handle)
        deadline = self.deadline(handle, cap_s)
        events: list[LifecycleEvent] = []
        errors = 0
        while True:
            bound = max(MIN_POLL_S, min(self.spec.poll_timeout_s, deadline - self.clock.now()))
            try:
                outcome = self._poll(handle.job_id, bound)
                errors = 0
            except ProviderError as e:
                errors += 1
                if errors >= self.spec.max_poll_errors:
                    return self._failed(handle, events, f"{e} ({errors} failed polls in a row)")
            else:
                if outcome.state != PENDING:
                    return self._finished(handle, outcome, events)
                if not events:
                    events.append(LifecycleEvent(self.elapsed_ms(handle), "pending"))
            now = self.clock.now()
            if now >= deadline:
                return self.timeout_result(handle, cap_s, events)
            self.sleep(min(self.spec.poll_interval_s, deadline - now))

    def cancel(self, handle: JobHandle) -> CancelReceipt:
        """Cancel the input, then poll for its end within ``cancel_confirm_s``.

        The cancel's return is only an acknowledgement; a poll showing the input ended (its
        remote error, an expired output, or an output that beat the cancel) confirms it.
        """
        self.check_handle(handle)
        receipt = CancelReceipt(provider=self.name, job_id=handle.job_id)
        notes: list[str] = []
        refused = ""  # the cancel call's own failure: kept whatever the confirming polls add
        call_id = handle.job_id
        receipt.cancel_sent_ms = self.now_ms()
        try:
            self._call(
                "cancel", lambda: self.client.cancel(call_id), self.spec.cancel_timeout_s, "cancel"
            )
            metrics.provider_call(self.name, "cancel")
            receipt.cancel_ack_ms = self.now_ms()
            receipt.upgrade(Evidence.PROVIDER_ACK)
            receipt.scope = CancelScope.REQUEST  # the input, not its container
        except ConfigError:
            raise
        except Exception as e:
            refused = f"cancel call failed: {self.scrub(_text(e))}"
        window_end = self.clock.now() + self.spec.cancel_confirm_s
        while True:
            bound = max(MIN_POLL_S, min(self.spec.poll_timeout_s, window_end - self.clock.now()))
            try:
                outcome = self._poll(call_id, bound)
                if outcome.state != PENDING:
                    self._input_ended(receipt, handle, outcome, notes)
                    break
            except ProviderError as e:
                notes.append(f"confirming poll failed: {e}")
            now = self.clock.now()
            if now >= window_end:
                window = f"{self.spec.cancel_confirm_s:g} s"
                notes.append(f"the input had not ended {window} after the cancel")
                receipt.estimated_cost_usd = self.cost_usd(now - handle.submitted_at)
                break
            self.sleep(min(self.spec.poll_interval_s, window_end - now))
        if receipt.evidence is not Evidence.NO_EVIDENCE:
            notes.append(IDLE_NOTE)
        receipt.note = cancel_note(refused, notes)
        return receipt

    # --- internals --------------------------------------------------------------------------

    # --- account hooks (login-check, costs): see providers/account_checks.py ----------------

    def login_check(self) -> LoginCheck:
        return account_checks.modal_login_check(self)

    def reported_spend(self, since: float) -> SpendReport:
        return account_checks.modal_spend(self, since)

    def _call(self, route: str, fn: Any, timeout_s: float, what: str, on_late: Any = None) -> Any:
        """One bounded SDK call; a failure is counted here, a success by the caller (a spawn's
        answer may still be unreadable). A call that never started (every SDK thread busy)
        reached nobody: not counted."""
        try:
            return self.calls.run(fn, timeout_s, what, on_late)
        except SdkCallTimeout as e:
            if e.started:
                metrics.provider_call(self.name, route, "timeout")
            raise
        except ConfigError:
            raise
        except Exception:
            metrics.provider_call(self.name, route, "rejected")
            raise

    def _poll(self, call_id: str, timeout_s: float) -> Outcome:
        try:
            outcome = self._call("status", lambda: self.client.poll(call_id), timeout_s, "poll")
            metrics.provider_call(self.name, "status")
            return outcome
        except ConfigError:
            raise
        except Exception as e:  # SdkCallTimeout, ModalSdkError, a seam bug
            text = self.scrub(_text(e))
            raise ProviderError(self.name, f"poll of call {call_id!r}: {text}") from None

    def _reap_late(self, future: Future[Any]) -> None:
        """A spawn answered after its timeout: nobody knows this call, so cancel it now."""
        if future.cancelled() or future.exception() is not None:
            return
        call_id = future.result()
        log.error(
            "provider %r: spawn answered after its %g s timeout with call %s; cancelling it",
            self.name,
            self.spec.spawn_timeout_s,
            call_id,
        )
        try:
            self.client.cancel(str(call_id))
            metrics.provider_call(self.name, "cancel")
        except Exception as e:
            metrics.provider_call(self.name, "cancel", "rejected")
            log.error(
                "provider %r: cancel of late call %s failed: %s",
                self.name,
                call_id,
                self.scrub(_text(e)),
            )

    def _finished(
        self, handle: JobHandle, outcome: Outcome, events: list[LifecycleEvent]
    ) -> AttemptResult:
        at = self.elapsed_ms(handle)
        if outcome.state == EXPIRED:
            error = f"{OUTCOME_UNKNOWN} ({outcome.error})"
            events = [*events, LifecycleEvent(at, "expired", "outcome unknown")]
            return AttemptResult(
                self.name,
                handle.job_id,
                JobState.FAILED,
                at,
                metrics={"outcome_unknown": True},
                events=events,
                error=error,
            )
        if outcome.state == FAILED:
            state = _state(outcome)
            said = {"user_exception": "the function raised ", "cancelled": "cancelled: "}
            error = self.scrub(f"{said.get(outcome.kind or '', '')}{outcome.error}")
            events = [*events, LifecycleEvent(at, state.value.lower(), outcome.kind or "")]
            return AttemptResult(self.name, handle.job_id, state, at, events=events, error=error)
        try:
            payload = _json_safe(outcome.output)
            if self.spec.payload:
                payload = get_path(payload, self.spec.payload)
        except MissingField:
            return self._failed(handle, events, f"the return value has no {self.spec.payload!r}")
        except (TypeError, ValueError) as e:
            return self._failed(handle, events, f"the return value is not JSON data: {e}")
        events = [*events, LifecycleEvent(at, "completed")]
        return AttemptResult(
            self.name, handle.job_id, JobState.COMPLETED, at, payload, events=events
        )

    def _failed(self, handle: JobHandle, events: list[LifecycleEvent], error: str) -> AttemptResult:
        at = self.elapsed_ms(handle)
        events = [*events, LifecycleEvent(at, "failed", "provider error")]
        return AttemptResult(
            self.name, handle.job_id, JobState.FAILED, at, events=events, error=self.scrub(error)
        )

    def _input_ended(
        self, receipt: CancelReceipt, handle: JobHandle, outcome: Outcome, notes: list[str]
    ) -> None:
        """Record an observed end of the input (the only thing that confirms a Modal cancel)."""
        at_ms = self.now_ms()
        if outcome.state == COMPLETED:
            receipt.confirm_terminal(JobState.COMPLETED, at_ms)
            receipt.scope = CancelScope.UNKNOWN  # it finished: nothing was stopped
            notes.append("the call completed before the cancel took effect")
        else:
            receipt.confirm_terminal(JobState.CANCELLED, at_ms)
            seen = "its output expired" if outcome.state == EXPIRED else outcome.error
            notes.append(f"the input ended after the cancel ({self.scrub(str(seen))})")
        receipt.estimated_cost_usd = self.cost_usd(at_ms / 1000.0 - handle.submitted_at)

    def secrets(self) -> tuple[str, ...]:
        return tuple(self._secrets)


def _state(outcome: Outcome) -> JobState:
    if outcome.state == PENDING:
        return JobState.IN_PROGRESS
    if outcome.state == COMPLETED:
        return JobState.COMPLETED
    if outcome.state == FAILED and outcome.kind == "cancelled":
        return JobState.CANCELLED
    return JobState.FAILED  # a remote failure, or an expired output (over, outcome unknown)


def _text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, (ModalSdkError, SdkCallTimeout)) else describe(exc)


def _json_safe(value: Any) -> Any:
    """The return value as JSON data (bytes become base64 text); TypeError when it is not."""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    json.dumps(value)
    return value
