"""The ``runpod`` adapter: RunPod Serverless's own job API, natively (docs/providers.md).

- **submit** ``POST /run {input, policy?, webhook?}`` -> ``{id, status}``; never retried (no
  idempotency key): a lost answer is "submit outcome unknown", which the race flags as a leak.
- **status** ``GET /status/{id}`` -> ``{status, delayTime, executionTime, output?}``; states
  ``IN_QUEUE`` -> QUEUED, ``IN_PROGRESS``/``RUNNING`` -> IN_PROGRESS, ``COMPLETED``,
  ``FAILED``, ``CANCELLED``; ``TIMED_OUT`` (RunPod stopped it at its ``executionTimeout``) ->
  FAILED, with the state named in the error. A 404 (RunPod keeps results 30 min)
  means the outcome can no longer be learnt: ``result`` reports it FAILED with that reason,
  ``cancel`` a leaked receipt; nothing crashes.
- **cancel** ``POST /cancel/{id}`` is an acknowledgement only; the receipt is confirmed by a
  later ``/status`` in a terminal state. That terminal state is RunPod's own proof that the
  job's execution (and its billing) ended, with its final ``executionTime``: only then is
  ``billing_stop_confirmed`` set. A job cancelled while queued shows 0 ms execution: $0.
- **pacing** (webhooks off): the race's watch asks :meth:`status_and_next_change`, which
  answers the job's state and when to look again (:meth:`next_poll_at`), and polls once more
  just before each of the policy's decisions (``polls_before_decisions``); polls are rate
  budgeted fleet-wide (:mod:`.ratelimit`) and a poll the budget cannot fit is deferred
  (:class:`~gpuhedge_celery.errors.RateLimited`), never made over the limit.
- **health** ``GET /health`` at most once per ``health_interval_s`` per endpoint per process,
  shared by all of its races (:meth:`health`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from ..core.receipts import CancelReceipt, CancelScope, Evidence
from ..errors import ConfigError, ProviderError, ProviderProtocolError, RateLimited, SubmitError
from ..metrics import record as metric_record
from . import runpod_account
from .account import LoginCheck, SpendReport
from .base import Provider, believable_ms, cancel_note, reported_ms
from .failed_result import failed_result
from .httpspec import MissingField, get_path
from .options import Block
from .runpod_api import JobUnknown, RunpodApi
from .runpod_spec import RunpodSpec

if TYPE_CHECKING:
    from ..config import ProviderConfig

log = logging.getLogger(__name__)

STATES = {
    "IN_QUEUE": JobState.QUEUED,
    "IN_PROGRESS": JobState.IN_PROGRESS,
    "RUNNING": JobState.IN_PROGRESS,
    "COMPLETED": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    # RunPod stopped it at its policy's executionTimeout: ended, not right-censored by our cap
    # (the race's TIMEOUT means "still running, maybe": it would cancel a job already stopped)
    "TIMED_OUT": JobState.FAILED,
}
MEMO = 4096  # job answers kept per process (a fresh submit's state; terminal answers)
RESERVED_EARLY_S = 0.005  # a timer may fire a little before its slot: still the same slot


class _Memo:
    """A small bounded map shared by the threads of one process."""

    def __init__(self, size: int = MEMO):
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)


class _Health:
    """``/health`` per endpoint for a whole process: fetched at most once per interval."""

    _lock = threading.Lock()
    _seen: dict[str, tuple[float, Any]] = {}  # endpoint root -> (monotonic time, answer)
    _busy: set[str] = set()
    _pid = os.getpid()

    @classmethod
    def get(cls, api: RunpodApi, interval_s: float, fetch: bool = True) -> Any:
        now = time.monotonic()
        with cls._lock:
            if cls._pid != os.getpid():  # a forked child: its parent's fetch is not its own
                cls._seen, cls._busy, cls._pid = {}, set(), os.getpid()
            at, value = cls._seen.get(api.root, (None, None))
            fresh = at is not None and now - at < interval_s
            if fresh or not fetch or api.root in cls._busy:
                return value  # one thread fetches; the others use what is known
            cls._busy.add(api.root)
        try:
            value = api.health()
        except ProviderError:
            value = None  # cached too: a failing /health is not asked again this interval
        finally:
            with cls._lock:
                cls._seen[api.root] = (time.monotonic(), value)
                cls._busy.discard(api.root)
        return value


EXECUTION_TIMEOUT_MIN_MS = 5001  # RunPod refuses an executionTimeout of 5 s or less
WEBHOOK_READ_S = 5.0  # how long a delivery's verifying /status read may wait for a token


class RunpodProvider(Provider):
    """One RunPod serverless endpoint (see the module docstring)."""

    adapter = "runpod"
    delivery_is_verified = True  # webhook_result reads /status: RunPod decides, not the body
    reports_queue_state = True
    #: the race's watch polls once just before each policy decision (a hedge, an escalation)
    #: and the race's deadline, so the race decides on a fresh state; between them the pacing
    #: is :meth:`next_poll_at`
    polls_before_decisions = True

    def __init__(
        self,
        name: str,
        spec: RunpodSpec,
        *,
        env: Mapping[str, str] | None = None,
        transport: Any = None,
        limiter: Any = None,
        balances: Any = None,
        **kwargs: Any,
    ):
        super().__init__(name, **kwargs)
        self.spec = spec
        self.balances = balances  # a BalanceStore: where ``costs`` keeps balance snapshots
        self.api = RunpodApi(
            name,
            spec,
            env=env,
            transport=transport,
            limiter=limiter,
            sleep=self.sleep,
            clock=self.clock.now,
        )
        self._fresh = _Memo()  # job id -> (state, when) from its own submit's answer
        self._terminal = _Memo()  # job id -> its terminal /status answer (final facts)

    def __repr__(self) -> str:
        return f"RunpodProvider(name={self.name!r}, endpoint={self.api.endpoint_id!r})"

    def secrets(self) -> tuple[str, ...]:
        return (self.api._key,)  # noqa: SLF001 - the adapter and its API client are one

    @classmethod
    def parse_options(cls, block: Block, *, time_scale: float | None = None) -> RunpodSpec:
        return RunpodSpec.from_block(block)  # RunPod runs in real time: nothing is scaled

    @classmethod
    def from_config(cls, cfg: ProviderConfig, **kwargs: Any) -> RunpodProvider:
        if not isinstance(cfg.spec, RunpodSpec):
            raise ConfigError(
                "the runpod adapter needs a runpod block",
                file=cfg.source,
                key=f"providers.{cfg.name}.runpod",
            )
        kwargs.pop("ledger", None)  # the sim's build argument
        spec = with_cap_as_timeout(cfg.spec, cfg.timeout_s)
        return cls(
            cfg.name,
            spec,
            billed_rate_per_s=cfg.billed_rate_per_s,
            idle_billed_seconds=cfg.idle_billed_seconds,
            **kwargs,
        )

    def close(self) -> None:
        self.api.close()

    # ------------------------------------------------------------------ the contract
    def submit(
        self, request: dict[str, Any], *, context: Mapping[str, str] | None = None
    ) -> JobHandle:
        """``POST /run``, once. ``context`` (webhooks on: ``race_id``, ``attempt_id``,
        ``token``, ``url``) gives the job its webhook: the configured template filled in, or
        the receiver's ``url``; without a context no webhook is sent."""
        submitted_at = self.clock.now()
        body: dict[str, Any] = {"input": request}
        if self.spec.policy:
            body["policy"] = dict(self.spec.policy)
        if self.api.webhook and context is not None:
            try:
                body["webhook"] = self.api.webhook.format(**context)
            except (KeyError, IndexError, ValueError) as e:
                raise SubmitError(self.name, f"not sent: webhook template needs {e}") from None
        elif context is not None and context.get("url"):
            body["webhook"] = context["url"]
        # A launch thread may wait a little for a /run token; never retried (see the module).
        data = self.api.call(
            "run", "POST", "/run", body=body, max_block_s=max(2.0, self.spec.retries.max_block_s)
        )
        job_id = data.get("id") if isinstance(data, dict) else None
        if not isinstance(job_id, str) or not job_id:  # accepted, but under which id?
            raise self.api.outcome_unknown("run POST /run", f"field 'id' is {job_id!r}"[:120])
        state = STATES.get(str(data.get("status", "")).upper(), JobState.QUEUED)
        self._fresh.put(job_id, (state, self.clock.now()))
        return JobHandle(self.name, job_id, submitted_at, extra={"endpoint": self.api.endpoint_id})

    def status(self, handle: JobHandle) -> JobState:
        """One ``GET /status`` (always asked: decisions such as the cutover need it fresh),
        waiting at most ``retries.max_block_s`` for the budget or a retry."""
        return self._status(handle, self.spec.retries.max_block_s)[0]

    def status_and_next_change(
        self, handle: JobHandle, reserved: float | None = None
    ) -> tuple[JobState, float | None]:
        """The race watch's question: the state, and when to look again (None: terminal).

        A job submitted by this process less than ``poll.min_s`` ago is in the state its own
        submit answered (RunPod's, moments ago): no request is made for it. ``reserved``: the
        slot the budget reserved when it deferred this poll (``RateLimited.reserved``): spent
        now instead of a new token.
        """
        self.check_handle(handle)
        fresh = self._fresh.get(handle.job_id)
        now = self.clock.now()
        if fresh is not None and now - fresh[1] < self.spec.poll.min_s:
            return fresh[0], self.next_poll_at(handle, fresh[0], now)
        # Never a wait here: the watch's timer threads serve every race of the process. A poll
        # the budget (or RunPod's Retry-After, or a retry's backoff) cannot send now raises
        # RateLimited, and the watch looks again exactly then: with a slot reserved for it up
        # to a window ahead (``reserved``), so deferred polls queue for distinct slots instead
        # of all waking for the same next token.
        prepaid = reserved is not None and now >= reserved - RESERVED_EARLY_S
        window = self.spec.limits["status"].window_s
        state, _ = self._status(handle, 0.0, reserve_s=window, prepaid=prepaid)
        return state, None if state.terminal else self.next_poll_at(handle, state, now)

    def next_poll_at(self, handle: JobHandle, state: JobState, now: float) -> float:
        """When the watch should look again, webhooks off.

        The gap is ``fraction`` of the job's age, bounded by ``min_s`` and ``max_s``: fast
        near the start, where short jobs end, slower later (a job that has run 20 s is no
        likelier to end in the next 100 ms). A queued job while ``/health`` (cached, shared)
        shows an idle worker is about to start: ``min_s``. The race's watch adds one poll just
        before each of its policy's decisions (``polls_before_decisions``), a cutover polls
        at its decision point itself, and no poll is later than the attempt's cap.
        """
        poll = self.spec.poll
        gap = poll.fraction * max(0.0, now - handle.submitted_at)
        if state is JobState.QUEUED:
            health = _Health.get(self.api, self.spec.health_interval_s)
            if (_number(health, "workers.idle") or 0) > 0:
                gap = poll.min_s
        return now + min(poll.max_s, max(poll.min_s, gap))

    def result(self, handle: JobHandle, cap_s: float) -> AttemptResult:
        """The job's result once terminal (at once when it already is); TIMEOUT at the cap."""
        self.check_handle(handle)
        deadline = self.deadline(handle, cap_s)
        events: list[LifecycleEvent] = []
        last: JobState | None = None
        errors = 0
        while True:
            now = self.clock.now()
            try:
                state, data = self._status(handle, max(0.0, deadline - now))
                errors = 0
            except JobUnknown as e:
                return failed_result(self, handle, events, str(e))
            except RateLimited as e:
                state, data = None, None
                wait_until = e.retry_at
            except ProviderError as e:
                errors += 1
                if errors > self.spec.retries.attempts:
                    return failed_result(
                        self, handle, events, f"{e} ({errors} failed polls in a row)"
                    )
                state, data, wait_until = None, None, now + self.spec.poll.min_s
            if state is not None:
                if state is not last:
                    events.append(LifecycleEvent(self.elapsed_ms(handle), state.value.lower()))
                    last = state
                if state.terminal:  # a state read from an answer comes with that answer's data
                    return self._terminal_result(
                        handle, state, cast("dict[str, Any]", data), events
                    )
                wait_until = self.next_poll_at(handle, state, now)
            now = self.clock.now()
            if now >= deadline:
                return self.timeout_result(handle, cap_s, events)
            self.sleep(max(0.0, min(wait_until, deadline) - now))

    def webhook_result(self, handle: JobHandle, body: Any) -> AttemptResult | None:
        """A webhook delivery, verified: RunPod does not sign deliveries, so the body only says
        the job may have ended, and RunPod's own ``/status`` answer (an authenticated read)
        decides, as a poll would. None while that answer shows the job unfinished (a forged
        COMPLETED, FAILED or CANCELLED changes nothing). Raises ``ProviderProtocolError`` on a
        body that is not a status of this job (``id`` must be there and be the job's), and the
        read's own ``ProviderError`` when RunPod cannot be asked now (the delivery is retried)."""
        self.check_handle(handle)
        where = f"webhook (job {handle.job_id!r})"
        if not isinstance(body, dict) or not isinstance(body.get("status"), str):
            raise ProviderProtocolError(
                self.name, f"{where}: expected an object with a string 'status'"
            )
        if body.get("id") != handle.job_id:
            other = repr(body.get("id"))[:80]
            raise ProviderProtocolError(self.name, f"{where}: it names job {other}, not this one")
        try:  # the body's own figures are never used: RunPod's answer is
            state, data = self._status(handle, max_block_s=WEBHOOK_READ_S)
        except ProviderError as e:  # RunPod could not be asked now: the delivery is retried
            raise ProviderError(self.name, f"{where}: not verified: {_text(e)}") from e
        if not state.terminal:
            return None
        event = LifecycleEvent(self.elapsed_ms(handle), state.value.lower(), "webhook")
        return self._terminal_result(handle, state, data, [event])

    def cancel(self, handle: JobHandle) -> CancelReceipt:
        """``POST /cancel``, then ``/status`` until terminal within ``cancel_confirm_s``."""
        return self._cancel(handle, behind=False)

    def cancel_running(self, handle: JobHandle) -> CancelReceipt:
        """The cancel of a job seen running: its ``/cancel`` token waits behind the cancels of
        queued jobs (:class:`~gpuhedge_celery.providers.base.CancelsBehindQueued`)."""
        return self._cancel(handle, behind=True)

    def _cancel(self, handle: JobHandle, *, behind: bool) -> CancelReceipt:
        self.check_handle(handle)
        receipt = CancelReceipt(provider=self.name, job_id=handle.job_id)
        known = self._terminal.get(handle.job_id)
        if known is not None:  # this process already saw it end: nothing to stop, no call
            receipt.cancel_sent_ms = self.now_ms()
            self._confirm(receipt, handle, _state(known), known)
            receipt.note = f"already {_state(known)} before the cancel; nothing to stop"
            return receipt
        notes: list[str] = []
        refused = ""  # the cancel call's own failure: kept whatever the confirming reads add
        receipt.cancel_sent_ms = self.now_ms()
        try:
            # /cancel's budget is the tightest (100 per 10 s): it may wait for a token as
            # long as the confirmation window, which starts once the call was answered
            self.api.call(
                "cancel",
                "POST",
                "/cancel/{id}",
                job_id=handle.job_id,
                max_block_s=self.spec.cancel_confirm_s,
                behind=behind,
            )
            receipt.cancel_ack_ms = self.now_ms()
            receipt.upgrade(Evidence.PROVIDER_ACK)
        except JobUnknown as e:
            receipt.note = f"cancel: {_text(e)}"
            return receipt  # leaked, no evidence: nothing can be learnt about it any more
        except ProviderError as e:  # RateLimited included: the confirming polls still look
            refused = f"cancel call failed: {_text(e)}"
        receipt.token_wait_ms = round(self.api.token_wait_s() * 1000.0, 1)
        metric_record.cancel_token_wait(self.name, self.api.token_wait_s())
        window_end = self.clock.now() + self.spec.cancel_confirm_s
        while True:
            now = self.clock.now()
            try:
                state, data = self._status(handle, max(0.0, window_end - now))
                if state.terminal:
                    self._confirm(receipt, handle, state, data)
                    break
            except JobUnknown as e:
                notes.append(_text(e))
                break
            except ProviderError as e:
                notes.append(f"confirming status failed: {_text(e)}")
            now = self.clock.now()
            if now >= window_end:
                notes.append(f"no terminal state within {self.spec.cancel_confirm_s:g} s")
                receipt.estimated_cost_usd = self.cost_usd(now - handle.submitted_at)
                break
            self.sleep(min(self.spec.cancel_poll_s, window_end - now))
        if refused or notes:  # else keep what _confirm said
            receipt.note = cancel_note(refused, notes)
        return receipt

    def health(self, *, fetch: bool = True) -> dict[str, Any] | None:
        """The endpoint's ``/health`` (``jobs.inQueue``, ``workers.idle``...), read at most once
        per ``health_interval_s`` by this process for every race it runs; None if unknown."""
        found = _Health.get(self.api, self.spec.health_interval_s, fetch=fetch)
        return found if isinstance(found, dict) else None

    # ------------------------------------------------------------------ the account
    def login_check(self) -> LoginCheck:
        """GraphQL ``myself { id }``: the account id (:mod:`.runpod_account`)."""
        return runpod_account.login_check(self)

    def reported_spend(self, since: float) -> SpendReport:
        """The balance's drop between snapshots: balance-derived (:mod:`.runpod_account`)."""
        return runpod_account.reported_spend(self, since)

    # ------------------------------------------------------------------ internals
    def _status(
        self, handle: JobHandle, max_block_s: float, reserve_s: float = 0.0, prepaid: bool = False
    ) -> tuple[JobState, dict[str, Any]]:
        self.check_handle(handle)
        known = self._terminal.get(handle.job_id)
        if known is not None:
            return _state(known), known
        data = self.api.call(
            "status",
            "GET",
            "/status/{id}",
            job_id=handle.job_id,
            max_block_s=max_block_s,
            reserve_s=reserve_s,
            prepaid=prepaid,
        )
        where = f"status GET /status/{{id}} (job {handle.job_id!r})"
        if not isinstance(data, dict):
            raise ProviderProtocolError(
                self.name, f"{where}: expected an object, got {type(data).__name__}"
            )
        raw = data.get("status")
        if not isinstance(raw, str):
            raise ProviderProtocolError(
                self.name, f"{where}: field 'status' is missing or not a string: {raw!r}"
            )
        for field in ("delayTime", "executionTime"):
            value = data.get(field)
            if value is None or believable_ms(value):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                reported_ms(self.name, where, field, value)  # not a number: a protocol error
            # a number no job could have run: never priced, the answer is still read
            log.warning(
                "provider %r: %s: %s %r ms is not believable; ignored",
                self.name,
                where,
                field,
                value,
            )
            data = {k: v for k, v in data.items() if k != field}
        state = STATES.get(raw.strip().upper(), JobState.UNKNOWN)
        if state.terminal:
            self._terminal.put(handle.job_id, data)
        return state, data

    def _metrics(self, data: dict[str, Any]) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        if data.get("delayTime") is not None:
            metrics["delay_ms"] = float(data["delayTime"])
        if data.get("executionTime") is not None:
            metrics["execution_ms"] = float(data["executionTime"])
            metrics["cost_usd"] = self.cost_usd(metrics["execution_ms"] / 1000.0)
        health = self.health(fetch=False)
        if health is not None:
            metrics["endpoint_in_queue"] = _number(health, "jobs.inQueue")
            metrics["endpoint_workers_idle"] = _number(health, "workers.idle")
        return metrics

    def _terminal_result(
        self, handle: JobHandle, state: JobState, data: dict[str, Any], events: list[LifecycleEvent]
    ) -> AttemptResult:
        metrics, payload, error = self._metrics(data), None, None
        if state is JobState.COMPLETED:
            try:
                payload = get_path(data, self.spec.payload)
            except MissingField:
                return failed_result(
                    self,
                    handle,
                    events,
                    f"status GET /status/{{id}}: COMPLETED without field {self.spec.payload!r}",
                    metrics,
                )
        else:  # a job's error may echo what it was given: never a key
            error = self.scrub(f"{data.get('status')}: {data.get('error') or 'no error given'}")[
                :500
            ]
        metrics["runpod_status"] = data.get("status")
        return AttemptResult(
            self.name,
            handle.job_id,
            state,
            self.elapsed_ms(handle),
            payload,
            metrics,
            events,
            error,
        )

    def _confirm(
        self, receipt: CancelReceipt, handle: JobHandle, state: JobState, data: dict[str, Any]
    ) -> None:
        """Record a terminal ``/status`` answer: RunPod's own proof that the job stopped."""
        receipt.confirm_terminal(state, self.now_ms())
        receipt.billing_stop_confirmed = True  # its execution ended; executionTime is final
        execution_ms = _number(data, "executionTime")
        ran = execution_ms is not None and execution_ms > 0
        receipt.was_running = ran
        if execution_ms is not None:
            receipt.execution_ms_before_cancel = execution_ms
            receipt.reconciled_cost_usd = self.cost_usd(execution_ms / 1000.0)
        if state is JobState.CANCELLED and not ran:
            receipt.scope = CancelScope.QUEUED_JOB  # removed from the queue: no worker ran it
            receipt.estimated_cost_usd = 0.0
            receipt.reconciled_cost_usd = 0.0
        elif state is JobState.CANCELLED:
            receipt.scope = CancelScope.REQUEST
            receipt.estimated_cost_usd = receipt.reconciled_cost_usd
        else:
            receipt.scope = CancelScope.UNKNOWN  # it ended by itself first
            receipt.note = f"ended {state} before the cancel took effect"


def with_cap_as_timeout(spec: RunpodSpec, cap_s: float | None) -> RunpodSpec:
    """``spec`` whose job policy also carries the provider's cap as RunPod's own
    ``executionTimeout`` (unless the policy sets one): RunPod then stops a job that outruns
    the cap itself, with no ``/cancel`` to wait for a rate-limit token."""
    if cap_s is None or "executionTimeout" in spec.policy:
        return spec
    timeout_ms = max(EXECUTION_TIMEOUT_MIN_MS, math.ceil(cap_s * 1000.0))
    return replace(spec, policy={**spec.policy, "executionTimeout": timeout_ms})


def _state(data: dict[str, Any]) -> JobState:
    return STATES.get(str(data.get("status", "")).upper(), JobState.UNKNOWN)


def _number(data: Any, path: str) -> float | None:
    try:
        value = get_path(data, path) if data is not None else None
    except MissingField:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _text(error: Exception) -> str:
    """An error's text without the ``provider 'x': `` prefix (the receipt names it)."""
    return str(error).split(": ", 1)[-1]
